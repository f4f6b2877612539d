"""BackgroundSyncer against a local remote: ordering, error surfacing, retention, lifecycle.

Back-pressure (a full queue blocks ``submit``) needs a slow remote: it is tested in
``tests/integration/test_storage_s3.py`` through a delaying proxy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_ops.storage import BackgroundSyncer, SyncError
from rlhf_ops.storage.manifest import list_steps, read_latest, verify_checkpoint, write_manifest


def make_ckpt(run_dir: Path, step: int, *, commit: bool = True) -> Path:
    ckpt = run_dir / f"global_step_{step}"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "w.bin").write_bytes(bytes([step]) * 2048)
    if commit:
        write_manifest(ckpt, step=step)
    return ckpt


def test_submitted_checkpoints_are_synced_in_order(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with BackgroundSyncer(str(remote), max_queue=2) as syncer:
        for step in (1, 2, 3):
            syncer.submit(make_ckpt(tmp_path / "local", step))
        syncer.flush(timeout=60)
        assert [r.step for r in syncer.reports] == [1, 2, 3]
    assert list_steps(remote) == [1, 2, 3] and read_latest(remote) == 3
    assert all(verify_checkpoint(remote / f"global_step_{s}") == [] for s in (1, 2, 3))


def test_errors_surface_on_flush_once_and_do_not_stop_later_syncs(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    syncer = BackgroundSyncer(str(remote), max_queue=2)
    bad = make_ckpt(tmp_path / "local", 1, commit=False)
    syncer.submit(bad)
    syncer.submit(make_ckpt(tmp_path / "local", 2))
    with pytest.raises(SyncError, match="1 background checkpoint sync") as info:
        syncer.flush(timeout=60)
    assert list(info.value.failed) == [str(bad)]
    assert isinstance(info.value.__cause__, ValueError)  # "has no MANIFEST.json"
    assert list_steps(remote) == [2]
    syncer.flush(timeout=60)  # reported once
    syncer.close()
    with pytest.raises(RuntimeError, match="closed"):
        syncer.submit(bad)


def test_close_raises_errors_collected_since_the_last_flush(tmp_path: Path) -> None:
    syncer = BackgroundSyncer(str(tmp_path / "remote"))
    syncer.submit(make_ckpt(tmp_path / "local", 1, commit=False))
    with pytest.raises(SyncError):
        syncer.close(timeout=60)


def test_retention_after_each_sync_keeps_last_and_protected(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with BackgroundSyncer(str(remote), keep_last=1, protect=lambda: {1}) as syncer:
        for step in (1, 2, 3):
            syncer.submit(make_ckpt(tmp_path / "local", step))
    assert list_steps(remote) == [1, 3]


def test_bad_options_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        BackgroundSyncer(str(tmp_path), max_wrokers=2)
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        BackgroundSyncer(str(tmp_path), max_queue=0)
