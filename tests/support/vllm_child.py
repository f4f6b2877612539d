"""Run a vLLM test module as a child script: the engine needs a fresh process (its own env and threads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_EXIT = 77  # the child's exit status when vLLM cannot be imported or started here


def run_child(
    test_file: str, args: list[str], *, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python <test_file> <args>`` from the repository root; skips on ``SKIP_EXIT``, fails with its output."""
    proc = subprocess.run(
        [sys.executable, str(Path(test_file).resolve()), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode == SKIP_EXIT:
        pytest.skip(f"vLLM is not usable here: {proc.stdout.strip()[-300:]}")
    name = Path(test_file).name
    assert proc.returncode == 0, (
        f"{name} child failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc
