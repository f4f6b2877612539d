"""Finding committed checkpoints, eval reports, best step and retention on a local run folder + file:// store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ops.pipeline.checkpoints import best_step, collect_eval_reports, find_checkpoint, write_eval_report
from rlhf_ops.pipeline.evaluate import CheckpointNeverCommitted, checkpoint_ready
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.retention import sync_and_retain
from rlhf_ops.storage.manifest import update_latest, write_manifest


def _layout(tmp_path: Path, *, remote: bool = True) -> RunLayout:
    store = (tmp_path / "remote").as_uri() if remote else None
    return RunLayout.for_run(dag_id="rlhf_ppo", run_id="r1", work_dir=str(tmp_path / "work"), remote_store_url=store)


def _commit(layout: RunLayout, step: int) -> Path:
    ckpt = Path(layout.local_run_dir) / f"global_step_{step}"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "actor" / "shard.bin").write_bytes(bytes([step]) * 64)
    write_manifest(ckpt, step=step)
    update_latest(layout.local_run_dir, step)
    return ckpt


def _report(layout: RunLayout, step: int, value: float) -> None:
    ckpt = Path(layout.local_run_dir) / f"global_step_{step}"
    write_eval_report({"step": step, "metrics": {"eval/acc": value}}, step=step, local_dir=ckpt, layout=layout)


def test_find_checkpoint_needs_the_manifest(tmp_path: Path) -> None:
    layout = _layout(tmp_path, remote=False)
    (Path(layout.local_run_dir) / "global_step_2").mkdir(parents=True)  # files being written, no manifest
    assert find_checkpoint(2, layout) is None
    ckpt = _commit(layout, 4)
    assert find_checkpoint(4, layout) == str(ckpt)


def test_checkpoint_ready_waits_then_gives_up_when_training_ended(tmp_path: Path) -> None:
    layout = _layout(tmp_path, remote=False)
    assert checkpoint_ready(2, layout, train_state="running") is None
    assert checkpoint_ready(2, layout, train_state="up_for_retry") is None  # a retry may still commit it
    with pytest.raises(CheckpointNeverCommitted, match="training is success and global_step_2 was never committed"):
        checkpoint_ready(2, layout, train_state="success")
    _commit(layout, 2)
    assert checkpoint_ready(2, layout, train_state="success") is not None


def test_remote_checkpoint_found_after_sync(tmp_path: Path) -> None:
    from rlhf_ops.storage import sync_run_dir

    layout = _layout(tmp_path)
    _commit(layout, 2)
    assert layout.remote_run_url is not None
    sync_run_dir(layout.local_run_dir, layout.remote_run_url)
    import shutil

    shutil.rmtree(layout.local_run_dir)  # e.g. an Airflow worker that cannot see the trainer's disk
    assert find_checkpoint(2, layout) == f"{layout.remote_run_url}/global_step_2"


def test_eval_reports_written_beside_checkpoints_and_best_step(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    for step in (2, 4, 6):
        _commit(layout, step)
    _report(layout, 2, 0.5)
    _report(layout, 4, 0.75)
    _report(layout, 6, 0.75)  # a tie goes to the later step
    remote_eval = tmp_path / "remote" / "rlhf_ppo" / layout.run_key / "global_step_4" / "eval.json"
    assert json.loads(remote_eval.read_text())["metrics"]["eval/acc"] == 0.75
    reports = collect_eval_reports(layout)
    assert sorted(reports) == [2, 4, 6]
    assert best_step(reports, "eval/acc") == 6
    assert best_step(reports, "eval/acc", higher_is_better=False) == 2
    with pytest.raises(ValueError, match=r"eval_metric='eval/reward' is in no eval report; use one of \['eval/acc'\]"):
        best_step(reports, "eval/reward")
    assert best_step({}, "eval/acc") is None


def test_sync_and_retain_keeps_last_k_and_the_best(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    for step in (2, 4, 6, 8):
        _commit(layout, step)
    for step, value in ((2, 0.1), (4, 0.9), (6, 0.2), (8, 0.3)):
        _report(layout, step, value)
    result = sync_and_retain(layout, keep_last=1, metric="eval/acc")
    # keep_last=1 keeps step 8 (newest); step 4 is the best; 2 and 6 go, locally and remotely
    assert (result["best_step"], result["best_value"]) == (4, 0.9)
    assert result["synced_steps"] == [2, 4, 6, 8]
    assert result["deleted_local"] == [2, 6] and result["deleted_remote"] == [2, 6]
    local = sorted(p.name for p in Path(layout.local_run_dir).glob("global_step_*"))
    remote = sorted(p.name for p in (tmp_path / "remote" / "rlhf_ppo" / layout.run_key).glob("global_step_*"))
    assert local == remote == ["global_step_4", "global_step_8"]
