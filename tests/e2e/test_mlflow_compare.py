"""MLflow's compare view of two pipeline runs, in headless Chromium: the params that tell them apart are there.

Two runs are opened the way ``start_tracking`` opens them (real code, a real MLflow server), one GRPO and one
RLOO on the same data, with the training reward and the checkpoint evaluations logged by step as the pipeline
logs them. The compare page must show the ``pipeline.*`` params (preset, algorithm, model, data hash, platform
commit, DAG run) and both runs; the screenshot goes to ``$RLHF_SCREENSHOT_DIR`` (``docs/images`` for the README)
or a temporary folder.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_ops.pipeline.tracking import start_tracking
from rlhf_ops.tracking.mlflow_tracking import MlflowLogger
from tests.support.chromium import chromium_page
from tests.support.mlflow_server import mlflow_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tracking_uri() -> Iterator[str]:
    with mlflow_server() as uri:
        yield uri


def _run(uri: str, tmp: Path, *, algorithm: str, lr: float, run_id: str, rise: float) -> tuple[str, str]:
    manifest = tmp / f"manifest_{algorithm}.json"
    files = {"train.parquet": {"sha256": "1f3a" * 16}, "val.parquet": {"sha256": "9c2e" * 16}}
    manifest.write_text(json.dumps({"version": 1, "counts": {"train": 972, "val": 52}, "files": files}))
    config = {
        "algorithm": {"adv_estimator": algorithm, "use_kl_loss": True},
        "actor": {"optim": {"lr": lr}},
        "model": {"path": "builtin:tiny-llama"},
        "rollout": {"n": 16, "max_new_tokens": 1},
        "trainer": {"total_training_steps": 30, "save_freq": 10},
        "tracking": {"experiment": "rlhf-tiny-cpu"},
    }
    started = start_tracking(
        config=config,
        preset="tiny-cpu",
        dag_id="rlhf_ppo",
        dag_run_id=run_id,
        try_number=1,
        run_date=dt.datetime(2026, 12, 1, 13, 0 if algorithm == "grpo" else 5, tzinfo=dt.UTC),
        prepared={"manifest_url": str(manifest)},
        tracking_uri=uri,
    )
    logger = MlflowLogger(started["mlflow_run_id"], tracking_uri=uri, log_system_metrics=False)
    try:
        for step in range(1, 31):
            logger.log_metrics({"critic/score/mean": min(1.0, 0.01 + rise * step * step / 900)}, step=step)
        for step, acc in ((10, 0.39 * rise), (20, 0.91 * rise), (30, min(1.0, 1.05 * rise))):
            logger.log_metrics({"eval/acc": acc, "eval/reward/mean": acc}, step=step)
    finally:
        logger.close()
    return started["mlflow_run_id"], started["mlflow_experiment_id"]


def test_compare_view_of_two_runs(tracking_uri: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    a, exp = _run(tracking_uri, tmp_path, algorithm="grpo", lr=1e-3, run_id="manual__grpo", rise=1.0)
    b, _ = _run(tracking_uri, tmp_path, algorithm="rloo", lr=2e-3, run_id="manual__rloo", rise=0.8)
    shots = Path(os.environ.get("RLHF_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    query = urllib.parse.urlencode({"runs": json.dumps([a, b]), "experiments": json.dumps([exp])})
    with chromium_page(shots) as page:
        page.goto(f"{tracking_uri}/#/compare-runs?{query}")
        expect(page.get_by_text("pipeline.algorithm").first).to_be_visible()
        for text in ("pipeline.data_sha256", "pipeline.dag_run", "pipeline.platform_commit", "pipeline.model"):
            expect(page.get_by_text(text).first).to_be_visible()
        expect(page.get_by_text("rloo").first).to_be_visible()
        expect(page.get_by_text(re.compile(r"tiny-cpu/grpo/2026-12-01T13:00")).first).to_be_visible()
        with contextlib.suppress(Exception):
            page.get_by_role("button", name="Close").first.click(timeout=3_000)  # the assistant side panel
        page.get_by_text("Visualizations", exact=True).first.click()  # folded: the run and param tables come up
        page.set_viewport_size({"width": 1280, "height": 1350})
        expect(page.get_by_text("Show diff only").first).to_be_visible()
        page.wait_for_timeout(1500)  # tables settle after their data arrives
        page.screenshot(path=shots / "mlflow_compare.png")
    png = shots / "mlflow_compare.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
