"""The MLflow server SIGKILLed mid-run: training goes on, its metrics are buffered and reach MLflow once the server
is started again on the same port and stores (``MlflowLogger(buffered=True)``, what ``rlhf train`` uses).

The default case logs steps to a real ``mlflow server`` through the logger while the server is killed and
restarted (~1 min on 2 shared cores); the slow case does it to a real tiny ``rlhf train`` (local Ray cluster) and
checks every step's metrics in MLflow against the run's own ``metrics.jsonl``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from rlhf_ops.tracking.mlflow_tracking import MlflowLogger
from rlhf_ops.tracking.params import sanitize_keys
from tests.reliability.conftest import Figures
from tests.reliability.test_kill import _records, _train
from tests.support.mlflow_server import RestartableMlflowServer

pytestmark = pytest.mark.timeout(900)


def _metrics(step: int) -> dict[str, float]:
    return {"actor/pg_loss": 1.0 / step, "critic/score/mean": 0.25 * step, "timing_s/step": 10.0 + step}


def _history(client: MlflowClient, run_id: str) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}`` of every metric of the run (``system/*`` aside)."""
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("system/"):
            continue
        for m in client.get_metric_history(run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out


def test_metrics_logged_while_mlflow_is_killed_reach_it_after_the_restart(
    tmp_path: Path, figures: Figures, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rlhf_ops.tracking.metric_buffer")
    server = RestartableMlflowServer(tmp_path / "mlflow")
    url = server.start()
    try:
        client = MlflowClient(url)
        run_id = client.create_run(client.create_experiment("outage")).info.run_id
        logger = MlflowLogger(run_id, tracking_uri=url, log_system_metrics=False, buffered=True, flush_timeout_s=300)
        for step in (1, 2):
            logger.log_metrics(_metrics(step), step=step)
            assert _history(client, run_id)[step] == _metrics(step)  # sent before log_metrics returned
        killed = server.kill()
        waits = []
        for step in (3, 4, 5):  # the server is gone: logging must not wait for it
            start = time.monotonic()
            logger.log_metrics(_metrics(step), step=step)
            waits.append(time.monotonic() - start)
        assert max(waits) < 6.0, waits  # at most one probe (5 s timeout; refused at once here)
        down_at = time.monotonic()
        server.start()  # same port, same SQLite store and artifact folder
        restart_s = time.monotonic() - down_at
        for step in (6, 7):
            logger.log_metrics(_metrics(step), step=step)
        logger.close()
        report = logger.buffer_report
        assert report is not None
        history = _history(MlflowClient(url), run_id)
        assert history == {step: _metrics(step) for step in range(1, 8)}  # every step, each value once, equal
        assert (report.added, report.sent, report.unsent, report.dropped, report.outages) == (21, 21, 0, 0, 1)
        messages = [r.getMessage() for r in caplog.records]
        assert sum(f"MLflow at {url} is not answering" in m for m in messages) == 1, messages
        assert sum(f"MLflow at {url} answers again after" in m for m in messages) == 1, messages
    finally:
        server.stop()
    figures.record(
        mlflow_kills=1,
        mlflow_processes_killed=killed,
        mlflow_steps_logged_during_outage=3,
        mlflow_longest_log_wait_seconds=round(max(waits), 3),
        mlflow_outage_seconds=report.longest_outage_s,
        mlflow_restart_seconds=round(restart_s, 1),
        mlflow_values_sent=report.sent,
        mlflow_values_lost=report.unsent + report.dropped + report.rejected,
    )


STEPS, KILL_AFTER, DOWN_FOR = 8, 2, 2  # killed once step 2 is logged, started again 2 steps after the kill


def _wait_steps(run_dir: Path, n: int, proc: Any, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_records(run_dir)) < n:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"step {n} not logged within {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlhf_train_survives_an_mlflow_kill_and_every_step_reaches_mlflow(tmp_path: Path, figures: Figures) -> None:
    server = RestartableMlflowServer(tmp_path / "mlflow")
    url = server.start()
    run_dir, log = tmp_path / "tiny-cpu" / "demo", tmp_path / "train.log"
    try:
        client = MlflowClient(url)
        run_id = client.create_run(client.create_experiment("outage-train")).info.run_id
        overrides = [
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.logger=[console,jsonl,mlflow]",
            f"tracking.mlflow_uri={url}",
            "data.val_files=[]",
        ]
        os.environ["MLFLOW_RUN_ID"] = run_id  # _train passes the environment on
        try:
            proc = _train(tmp_path, overrides)
        finally:
            del os.environ["MLFLOW_RUN_ID"]
        _wait_steps(run_dir, KILL_AFTER, proc, log)
        # The JSONL line comes just before the MLflow send of the same step: let that send finish, or it would sit
        # in MLflow's own retries (up to 247 s) instead of meeting a failed health probe (the test would pass,
        # more slowly).
        time.sleep(1)
        killed = server.kill()
        killed_at, logged_at_kill = time.monotonic(), len(_records(run_dir))
        _wait_steps(run_dir, min(logged_at_kill + DOWN_FOR, STEPS), proc, log)
        steps_while_down = len(_records(run_dir)) - logged_at_kill
        assert steps_while_down >= 1, "the run ended before the kill: nothing was trained while MLflow was down"
        server.start()
        down_s = time.monotonic() - killed_at
        assert proc.wait(timeout=900) == 0, log.read_text(errors="replace")[-3000:]
        text = log.read_text(errors="replace")
        history = _history(MlflowClient(url), run_id)
    finally:
        server.stop()
    local = {int(r["step"]): r for r in _records(run_dir)}  # type: ignore[call-overload]
    assert sorted(local) == list(range(1, STEPS + 1))
    missing, different = [], []
    for step, record in local.items():
        values = sanitize_keys({k: v for k, v in record.items() if k not in ("step", "timestamp")}, what="test")
        for key, value in values.items():
            got = history.get(step, {}).get(key)
            if got is None:
                missing.append(f"{step}:{key}")
            elif not (got == value or (value is None and (math.isnan(got) or abs(got) > 1e300))):
                different.append(f"{step}:{key}: {got} != {value}")
    assert not missing and not different, (missing[:10], different[:10])
    # One line when the outage began (or, if a send was caught mid-request, when training stopped waiting for it).
    assert f"MLflow at {url} is not answering" in text or f"MLflow at {url} is slow to answer" in text, text[-3000:]
    figures.record(
        train_mlflow_kills=1,
        train_mlflow_processes_killed=killed,
        train_steps_while_mlflow_down=steps_while_down,
        train_mlflow_down_seconds=round(down_s, 1),
        train_steps_in_mlflow=len(history),
        train_values_checked=sum(len(r) - 2 for r in local.values()),
        train_values_missing=len(missing),
        train_values_different=len(different),
    )
