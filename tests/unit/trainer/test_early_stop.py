"""``trainer.early_stop``: the threshold and patience rules, resume state, the recorded outcome, and the DAG's
sensor skipping checkpoints after the stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from rlhf_ops.config import ConfigError
from rlhf_ops.config.reproducibility import EarlyStopConfig
from rlhf_ops.pipeline.checkpoints import (
    CheckpointNeverCommitted,
    CheckpointNotTrained,
    awaited_checkpoint,
    checkpoint_ready,
)
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.storage.manifest import write_manifest
from rlhf_ops.trainer.early_stop import EarlyStop, read_outcome, record_outcome

M = "val/reward/mean"


def _run(stop: EarlyStop, values: list[float]) -> int | None:
    for step, value in enumerate(values, start=1):
        metrics = {M: value, "actor/pg_loss": 0.1}
        if stop.update(metrics, step):
            assert metrics["training/early_stopped"] == 1.0
            return step
    return None


def test_threshold_stops_at_the_first_validation_that_reaches_it_in_either_direction() -> None:
    assert _run(EarlyStop(EarlyStopConfig(metric=M, threshold=0.8)), [0.1, 0.79, 0.8, 0.9]) == 3
    assert _run(EarlyStop(EarlyStopConfig(metric=M, mode="min", threshold=0.2)), [0.5, 0.3, 0.19]) == 3
    assert _run(EarlyStop(EarlyStopConfig(metric=M, threshold=2.0)), [0.1, 0.5]) is None


def test_patience_counts_validations_without_a_win_larger_than_min_delta() -> None:
    stop = EarlyStop(EarlyStopConfig(metric=M, patience=2, min_delta=0.05))
    assert _run(stop, [0.5, 0.6, 0.62, 0.64]) == 4  # 0.62, 0.64 beat 0.6 by < 0.05
    assert stop.best == 0.6 and stop.reason is not None and "patience 2" in stop.reason


def test_steps_without_validation_are_ignored_and_a_missing_metric_is_one_line() -> None:
    stop = EarlyStop(EarlyStopConfig(metric="val/copy/acc", threshold=1.0))
    assert stop.update({"actor/pg_loss": 0.1}, 1) is False
    with pytest.raises(ConfigError, match=r"trainer.early_stop.metric: val/copy/acc is not among .*val/reward/mean"):
        stop.update({M: 0.3, "val/response_length/mean": 2.0}, 2)


def test_a_resumed_rule_keeps_its_best_and_count() -> None:
    stop = EarlyStop(EarlyStopConfig(metric=M, patience=2))
    _run(stop, [0.5, 0.4])
    again = EarlyStop(EarlyStopConfig(metric=M, patience=2))
    again.load_state_dict(stop.state_dict())
    assert again.update({M: 0.45}, 3) is True  # second validation without a win


def test_the_time_budget_stops_when_one_more_step_as_long_as_the_slowest_of_the_last_three_would_overrun() -> None:
    stop = EarlyStop(EarlyStopConfig(max_time_s=130.0), started=time.time() - 100.0)  # 100 s used already
    metrics: dict[str, float] = {}
    assert stop.update(metrics, 1, step_s=25.0) is False  # 100 + 25 <= 130
    assert 99.0 < metrics["training/wall_clock_s"] < 110.0 and "training/early_stopped" not in metrics
    assert stop.update({}, 2, step_s=5.0) is False  # the slowest of the last three is still 25
    metrics = {}
    assert stop.update(metrics, 3, step_s=31.0) is True  # 100 + 31 > 130
    assert metrics["training/early_stopped"] == 1.0
    assert stop.reason is not None and stop.reason.startswith("wall-clock budget: 100 s used of ")
    assert "trainer.early_stop.max_time_s=130 and a step takes up to 31 s, at step 3" in stop.reason
    # only the last three steps count: a slow step stops the run while it is among them, not after
    for steps_after_the_slow_one, stops in ((1, True), (3, False)):
        stop = EarlyStop(EarlyStopConfig(max_time_s=140.0), started=time.time() - 50.0)
        assert stop.update({}, 1, step_s=45.0) is False  # 50 + 45 <= 140
        for step in range(2, 1 + steps_after_the_slow_one):
            assert stop.update({}, step, step_s=5.0) is False
        stop.started = time.time() - 100.0  # 100 s used now
        assert stop.update({}, 1 + steps_after_the_slow_one, step_s=5.0) is stops  # 100 + 45 > 140; 100 + 5 <= 140


def test_no_budget_logs_no_wall_clock_keeps_no_clock_and_never_stops() -> None:
    stop = EarlyStop(EarlyStopConfig(), started=time.time() - 1e6)
    metrics: dict[str, float] = {}
    assert stop.update(metrics, 1, step_s=1e6) is False and metrics == {}
    assert stop.state_dict() == {"best": None, "since_best": 0}  # a resumed run's state stays seed-determined


def test_a_resumed_run_counts_its_earlier_attempts_up_to_their_checkpoint() -> None:
    first = EarlyStop(EarlyStopConfig(max_time_s=100.0), started=time.time() - 60.0)
    saved = first.state_dict()
    assert 59.0 < saved["elapsed_s"] < 70.0
    again = EarlyStop(EarlyStopConfig(max_time_s=100.0), started=time.time() - 10.0)  # 10 s into the new attempt
    again.load_state_dict(saved)
    assert 69.0 < again.elapsed_s() < 80.0
    assert again.update({}, 5, step_s=15.0) is False  # ~70 + 15 <= 100
    assert again.update({}, 6, step_s=35.0) is True  # ~70 + 35 > 100


def test_by_default_the_budget_counts_from_the_process_start() -> None:
    import psutil

    stop = EarlyStop(EarlyStopConfig(max_time_s=10.0))
    assert stop.started == psutil.Process().create_time() and stop.elapsed_s() > 0.0


class _Tags:
    def __init__(self) -> None:
        self.tags: dict[str, object] = {}

    def set_tags(self, tags: dict[str, object]) -> None:
        self.tags.update(tags)


def test_the_outcome_is_written_and_the_sensor_skips_later_checkpoints_but_fails_earlier_missing_ones(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "work" / "exp" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "global_step_2").mkdir()
    (run_dir / "global_step_2" / "MANIFEST.json").write_text("{}")
    stop = EarlyStop(EarlyStopConfig(metric=M, threshold=0.5))
    stop.update({M: 0.7}, 2)
    tags = _Tags()
    record_outcome(stop, step=2, total_steps=6, run_dir=run_dir, remote_run_url=None, logger=tags)
    assert tags.tags["rlhf.outcome"] == "early_stopped" and tags.tags["rlhf.stopped_at_step"] == 2
    outcome = read_outcome(LocalFileSystem(), str(run_dir))
    assert outcome is not None and outcome["step"] == 2 and outcome["best"] == 0.7

    layout = RunLayout(
        work_dir=str(tmp_path),
        dag_id="exp",
        run_key="run",
        data_root=str(tmp_path),
        checkpoint_root=str(tmp_path / "work"),
        experiment="exp",
        local_run_dir=str(run_dir),
        remote_run_url=None,
        cache_dir=str(tmp_path),
        models_dir=str(tmp_path),
    )
    with pytest.raises(CheckpointNotTrained, match="stopped early at step 2"):
        checkpoint_ready(4, layout, train_state="success")
    with pytest.raises(CheckpointNeverCommitted) as info:
        checkpoint_ready(1, layout, train_state="success")  # before the stop: a real loss
    assert not isinstance(info.value, CheckpointNotTrained)


def test_the_first_planned_evaluation_after_an_unplanned_stop_takes_the_stopping_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for step in (2, 3):  # planned every 2 steps of 6; the time budget stopped the run after step 3
        (run_dir / f"global_step_{step}").mkdir(parents=True)
        (run_dir / f"global_step_{step}" / "weights.bin").write_bytes(b"w")
        write_manifest(run_dir / f"global_step_{step}", step=step)
    (run_dir / "outcome.json").write_text(json.dumps({"outcome": "early_stopped", "step": 3, "total_steps": 6}))
    layout = RunLayout(
        work_dir=str(tmp_path),
        dag_id="exp",
        run_key="run",
        data_root=str(tmp_path),
        checkpoint_root=str(tmp_path),
        experiment="exp",
        local_run_dir=str(run_dir),
        remote_run_url=None,
        cache_dir=str(tmp_path),
        models_dir=str(tmp_path),
    )
    planned = [2, 4, 6]
    assert awaited_checkpoint(2, layout, planned=planned, train_state="running") == (2, str(run_dir / "global_step_2"))
    assert awaited_checkpoint(4, layout, planned=planned, train_state="running") is None  # still training: wait
    assert awaited_checkpoint(4, layout, planned=planned, train_state="success") == (3, str(run_dir / "global_step_3"))
    with pytest.raises(CheckpointNotTrained, match="stopped early at step 3"):
        awaited_checkpoint(6, layout, planned=planned, train_state="success")
    # a stop at a planned step is that step's own evaluation: every later one is skipped
    with pytest.raises(CheckpointNotTrained, match="stopped early at step 3"):
        awaited_checkpoint(4, layout, planned=[3, 4, 6], train_state="success")
