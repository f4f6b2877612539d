"""sync / download / resume / retention against a ``file://`` remote (the same code paths as HDFS/WebHDFS)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from rlhf_ops.storage import (
    apply_remote_retention,
    download_checkpoint,
    find_latest_remote,
    sync_checkpoint,
    sync_run_dir,
)
from rlhf_ops.storage.manifest import (
    MANIFEST_NAME,
    CorruptCheckpointError,
    list_steps,
    read_latest,
    verify_checkpoint,
    write_manifest,
)

FILES = {"model/shard_0.distcp": b"w" * 3000, "optim/shard_0.distcp": b"o" * 1000, "trainer_state.json": b"{}"}


def make_ckpt(run_dir: Path, step: int, files: dict[str, bytes] | None = None, *, commit: bool = True) -> Path:
    ckpt = run_dir / f"global_step_{step}"
    for rel, data in (files or FILES).items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    if commit:
        write_manifest(ckpt, step=step)
    return ckpt


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "local" / "run", tmp_path / "remote" / "exp" / "run"


def test_sync_uploads_files_manifest_then_latest(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    ckpt = make_ckpt(local, 1)
    report = sync_checkpoint(ckpt, f"file://{remote}")
    assert sorted(report.uploaded) == sorted(FILES) and report.skipped == []
    assert report.bytes_uploaded == 3000 + 1000 + 2 and report.manifest_uploaded and report.latest_updated
    assert (remote / "global_step_1" / MANIFEST_NAME).read_bytes() == (ckpt / MANIFEST_NAME).read_bytes()
    assert verify_checkpoint(remote / "global_step_1") == []
    assert (remote / "latest").read_text() == "global_step_1"
    assert not (remote / "global_step_1" / ".sync").exists()  # markers go once the manifest is up


def test_second_sync_uploads_nothing(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    ckpt = make_ckpt(local, 1)
    sync_checkpoint(ckpt, str(remote))
    report = sync_checkpoint(ckpt, str(remote))
    assert report.uploaded == [] and sorted(report.skipped) == sorted(FILES)
    assert not report.manifest_uploaded and not report.latest_updated and report.bytes_uploaded == 0


def test_resaved_step_uploads_only_changed_files(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    ckpt = make_ckpt(local, 1)
    sync_checkpoint(ckpt, str(remote))
    (ckpt / "optim" / "shard_0.distcp").write_bytes(b"p" * 1000)  # same size, new bytes
    write_manifest(ckpt, step=1)
    report = sync_checkpoint(ckpt, str(remote))
    assert report.uploaded == ["optim/shard_0.distcp"] and report.manifest_uploaded
    assert verify_checkpoint(remote / "global_step_1") == []


def test_interrupted_sync_resumes_only_files_vouched_for_by_a_marker(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    ckpt = make_ckpt(local, 1)
    # What an interrupted sync leaves: files, markers written after complete files, no manifest.
    rckpt = remote / "global_step_1"
    for rel in FILES:
        (rckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (rckpt / rel).write_bytes((ckpt / rel).read_bytes())
    sha_model = hashlib.sha256(FILES["model/shard_0.distcp"]).hexdigest()
    (rckpt / ".sync" / "model").mkdir(parents=True)
    (rckpt / ".sync" / "model" / f"shard_0.distcp.sha256-{sha_model}").touch()
    (rckpt / ".sync" / f"trainer_state.json.sha256-{'0' * 64}").touch()  # stale: another content
    report = sync_checkpoint(ckpt, str(remote))
    # model: marker matches -> skipped; optim: no marker -> re-uploaded; trainer_state: stale marker -> re-uploaded
    assert report.skipped == ["model/shard_0.distcp"]
    assert sorted(report.uploaded) == ["optim/shard_0.distcp", "trainer_state.json"]
    assert verify_checkpoint(rckpt) == [] and not (rckpt / ".sync").exists()


def test_sync_refuses_uncommitted_misnamed_or_damaged_local_checkpoints(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    with pytest.raises(ValueError, match="has no MANIFEST.json"):
        sync_checkpoint(make_ckpt(local, 1, commit=False), str(remote))
    other = local / "step_2"
    other.mkdir(parents=True)
    with pytest.raises(ValueError, match="must be named global_step_<N>"):
        sync_checkpoint(other, str(remote))
    ckpt = make_ckpt(local, 3)
    (ckpt / "trainer_state.json").write_bytes(b"{")
    with pytest.raises(
        CorruptCheckpointError, match=r"trainer_state.json: size mismatch \(manifest 2 bytes, found 1\)"
    ):
        sync_checkpoint(ckpt, str(remote))
    assert not (remote / "global_step_3" / MANIFEST_NAME).exists()
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        sync_checkpoint(make_ckpt(local, 4), str(remote), max_workers=0)


def test_latest_never_moves_back_to_an_older_step(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    sync_checkpoint(make_ckpt(local, 2), str(remote))
    report = sync_checkpoint(make_ckpt(local, 1), str(remote))
    assert report.manifest_uploaded and not report.latest_updated
    assert read_latest(remote) == 2


def test_sync_run_dir_syncs_complete_checkpoints_and_points_latest(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    make_ckpt(local, 1)
    make_ckpt(local, 2)
    make_ckpt(local, 3, commit=False)  # still being written
    result = sync_run_dir(local, str(remote))
    assert [r.step for r in result.reports] == [1, 2] and result.latest_step == 2
    assert list_steps(remote) == [1, 2] and "latest: global_step_2" in str(result)
    again = sync_run_dir(local, str(remote))
    assert [r.uploaded for r in again.reports] == [[], []]


def test_download_verifies_and_places_in_one_rename(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    local, remote = dirs
    sync_checkpoint(make_ckpt(local, 1), str(remote))
    dest = tmp_path / "restore" / "global_step_1"
    manifest = download_checkpoint(str(remote / "global_step_1"), dest)
    assert manifest.step == 1 and verify_checkpoint(dest) == []
    assert sorted(os.listdir(dest.parent)) == ["global_step_1"]  # no temp folder left
    with pytest.raises(FileExistsError, match="overwrite=True"):
        download_checkpoint(str(remote / "global_step_1"), dest)
    (dest / "trainer_state.json").write_bytes(b"local edit")
    download_checkpoint(str(remote / "global_step_1"), dest, overwrite=True)
    assert (dest / "trainer_state.json").read_bytes() == b"{}"
    assert sorted(os.listdir(dest.parent)) == ["global_step_1"]


def test_download_of_a_corrupt_checkpoint_names_the_file_and_places_nothing(dirs: tuple[Path, Path], tmp_path: Path):
    local, remote = dirs
    sync_checkpoint(make_ckpt(local, 1), str(remote))
    (remote / "global_step_1" / "optim" / "shard_0.distcp").write_bytes(b"x" * 1000)
    dest = tmp_path / "restore" / "global_step_1"
    with pytest.raises(CorruptCheckpointError) as info:
        download_checkpoint(str(remote / "global_step_1"), dest)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("optim/shard_0.distcp: sha256 mismatch")
    assert os.listdir(dest.parent) == []


def test_download_of_an_incomplete_checkpoint_is_refused(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    local, remote = dirs
    make_ckpt(remote, 5, commit=False)
    with pytest.raises(FileNotFoundError, match="has no MANIFEST.json: the remote checkpoint is incomplete"):
        download_checkpoint(str(remote / "global_step_5"), tmp_path / "restore")


def test_remote_resume_scan_and_retention(dirs: tuple[Path, Path]) -> None:
    local, remote = dirs
    for step in (1, 2, 3):
        sync_checkpoint(make_ckpt(local, step), str(remote))
    make_ckpt(remote, 4, commit=False)  # an upload in progress
    assert find_latest_remote(f"file://{remote}") == (3, f"file://{remote}/global_step_3")
    assert apply_remote_retention(str(remote), keep_last=1, protect={1}) == [2]
    assert list_steps(remote) == [1, 3, 4]
    assert find_latest_remote(str(remote / "empty")) is None
