"""Headless Chromium for the UI tests: a Playwright page in Debian's Chromium and screenshot helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import FloatRect, Page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}


@contextlib.contextmanager
def chromium_page(shots: Path) -> Iterator[Page]:
    """A 1280x800 page in Debian's Chromium; a screenshot ``failure.png`` if the block raises."""
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} not found: apt-get install -y chromium")
    from playwright.sync_api import expect, sync_playwright

    # Assertions wait up to 30 s (Playwright's default is 5 s): the UI renders slowly on a loaded 2-core machine.
    expect.set_options(timeout=30_000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)  # type: ignore[arg-type]
            page.set_default_timeout(30_000)
            try:
                yield page
            except BaseException:
                with contextlib.suppress(Exception):
                    page.screenshot(path=shots / "failure.png")
                raise
        finally:
            browser.close()


def settle(page: Page) -> None:
    """Wait until the page has fetched what it shows (grid squares, log lines) before a screenshot."""
    with contextlib.suppress(Exception):
        page.wait_for_load_state("networkidle", timeout=10_000)


def around(page: Page, selector: str, *, margin: int) -> FloatRect:
    """The box around every element matching ``selector``, plus ``margin`` pixels, inside the viewport."""
    boxes = [b for b in (el.bounding_box() for el in page.locator(selector).all()) if b is not None]
    assert boxes, selector
    x0 = max(0.0, min(b["x"] for b in boxes) - margin)
    y0 = max(0.0, min(b["y"] for b in boxes) - margin)
    x1 = min(float(VIEWPORT["width"]), max(b["x"] + b["width"] for b in boxes) + margin)
    y1 = min(float(VIEWPORT["height"]), max(b["y"] + b["height"] for b in boxes) + margin)
    return {"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0}


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
