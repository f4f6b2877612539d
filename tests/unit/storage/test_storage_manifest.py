"""rlhf_ops.storage.manifest on local disk: manifest, verification, ``latest``, resume scan, retention."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlhf_ops.storage.manifest import (
    MANIFEST_NAME,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    apply_retention,
    atomic_write_local,
    find_latest_complete,
    is_complete,
    list_steps,
    read_latest,
    read_manifest,
    update_latest,
    verify_checkpoint,
    write_manifest,
)

# FIPS 180-2 test vector: sha256("abc"); and the sha256 of zero bytes.
SHA_ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
SHA_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def make_ckpt(run_dir: Path, step: int, files: dict[str, bytes], *, commit: bool = True) -> Path:
    ckpt = run_dir / f"global_step_{step}"
    for rel, data in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    ckpt.mkdir(parents=True, exist_ok=True)
    if commit:
        write_manifest(ckpt, step=step)
    return ckpt


def test_write_manifest_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 7, {"a.bin": b"abc", "sub/empty.txt": b""}, commit=False)
    manifest = write_manifest(ckpt, step=7, extra={"reward": 0.5})
    assert manifest.files == [
        FileEntry(path="a.bin", size=3, sha256=SHA_ABC),
        FileEntry(path="sub/empty.txt", size=0, sha256=SHA_EMPTY),
    ]
    on_disk = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert on_disk["version"] == 1 and on_disk["step"] == 7 and on_disk["extra"] == {"reward": 0.5}
    assert on_disk["files"][0] == {"path": "a.bin", "size": 3, "sha256": SHA_ABC}
    assert read_manifest(ckpt) == manifest
    assert sorted(p.name for p in ckpt.iterdir()) == [MANIFEST_NAME, "a.bin", "sub"]  # no temp file left


def test_rewriting_the_manifest_never_lists_itself_or_its_temp_files(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 1, {"a.bin": b"abc"})
    (ckpt / f".{MANIFEST_NAME}.x1.tmp").write_bytes(b"left by a crash")
    assert [e.path for e in write_manifest(ckpt, step=1).files] == ["a.bin"]


def test_write_manifest_needs_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        write_manifest(tmp_path / "missing", step=0)


def test_verify_names_each_missing_truncated_and_altered_file(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 1, {"a.bin": b"abc", "b.bin": b"abc", "c.bin": b"abc", "ok.bin": b"abc"})
    (ckpt / "a.bin").unlink()
    (ckpt / "b.bin").write_bytes(b"ab")
    (ckpt / "c.bin").write_bytes(b"abd")  # same size, other bytes
    problems = verify_checkpoint(ckpt)
    assert problems[:2] == ["a.bin: missing", "b.bin: size mismatch (manifest 3 bytes, found 2)"]
    assert len(problems) == 3 and problems[2].startswith("c.bin: sha256 mismatch (manifest ba7816bf8f01")
    assert verify_checkpoint(ckpt, check_hashes=False) == problems[:2]


def test_verify_and_is_complete_without_a_manifest(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 1, {"a.bin": b"abc"}, commit=False)
    assert verify_checkpoint(ckpt) == [f"{MANIFEST_NAME}: missing (checkpoint incomplete)"]
    assert not is_complete(ckpt)


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../b", "a//b", "./a", "a\\b", "", MANIFEST_NAME])
def test_file_entry_rejects_paths_that_escape_or_are_not_normalised(path: str) -> None:
    with pytest.raises(ValidationError):
        FileEntry(path=path, size=0, sha256=SHA_EMPTY)


def test_unreadable_or_newer_manifest_is_corrupt(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 1, {"a.bin": b"abc"})
    (ckpt / MANIFEST_NAME).write_text('{"version": 2, "step": 1, "created_at": "x", "files": []}')
    with pytest.raises(CorruptCheckpointError, match="MANIFEST.json: unreadable"):
        read_manifest(ckpt)
    assert not is_complete(ckpt)
    (ckpt / MANIFEST_NAME).write_text("{not json")
    assert verify_checkpoint(ckpt)[0].startswith("MANIFEST.json: unreadable")


def test_manifest_of_another_step_makes_the_folder_incomplete(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 3, {"a.bin": b"abc"}, commit=False)
    write_manifest(ckpt, step=4)
    assert not is_complete(ckpt)


def test_update_latest_only_after_the_manifest(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 2, {"a.bin": b"abc"}, commit=False)
    with pytest.raises(ValueError, match="has no MANIFEST.json"):
        update_latest(tmp_path, 2)
    write_manifest(tmp_path / "global_step_2", step=2)
    update_latest(tmp_path, 2)
    assert (tmp_path / "latest").read_text() == "global_step_2"
    assert read_latest(tmp_path) == 2


def test_find_latest_complete_skips_incomplete_and_optionally_corrupt(tmp_path: Path) -> None:
    assert find_latest_complete(tmp_path / "nothing") is None
    make_ckpt(tmp_path, 1, {"a.bin": b"abc"})
    make_ckpt(tmp_path, 2, {"a.bin": b"abc"})
    make_ckpt(tmp_path, 3, {"a.bin": b"abc"}, commit=False)  # crashed while saving
    update_latest(tmp_path, 1)  # lags: the process died between manifest 2 and the pointer
    assert list_steps(tmp_path) == [1, 2, 3]
    assert find_latest_complete(tmp_path) == (2, f"{tmp_path}/global_step_2")
    (tmp_path / "global_step_2" / "a.bin").write_bytes(b"abd")
    assert find_latest_complete(tmp_path) == (2, f"{tmp_path}/global_step_2")  # manifest presence only
    assert find_latest_complete(tmp_path, verify_hashes=True) == (1, f"{tmp_path}/global_step_1")


def _run_with_steps(tmp_path: Path, complete: list[int], incomplete: list[int]) -> Path:
    for step in complete:
        make_ckpt(tmp_path, step, {"w.bin": b"abc"})
    for step in incomplete:
        make_ckpt(tmp_path, step, {"w.bin": b"ab"}, commit=False)
    return tmp_path


def test_retention_keeps_last_protected_latest_and_in_progress(tmp_path: Path) -> None:
    run = _run_with_steps(tmp_path, complete=[1, 2, 3, 5], incomplete=[4, 6])
    update_latest(run, 5)
    # newest complete = 5; keep = protect {1} | newest {5} | last-1 {5} | latest {5};
    # delete the rest below 5: 2, 3 (complete) and 4 (abandoned); 6 may still be written.
    assert apply_retention(run, keep_last=1, protect={1}) == [2, 3, 4]
    assert list_steps(run) == [1, 5, 6]


def test_retention_keeps_what_latest_names_and_keep_last_zero_keeps_every_complete(tmp_path: Path) -> None:
    run = _run_with_steps(tmp_path, complete=[1, 2, 3, 5], incomplete=[4])
    update_latest(run, 3)
    assert apply_retention(run, keep_last=0) == [4]  # only the abandoned incomplete one
    assert apply_retention(run, keep_last=1) == [1, 2]  # 3 stays: latest names it


def test_retention_deletes_nothing_without_a_complete_checkpoint(tmp_path: Path) -> None:
    run = _run_with_steps(tmp_path, complete=[], incomplete=[1, 2])
    assert apply_retention(run, keep_last=1) == []
    assert list_steps(run) == [1, 2]


def test_retention_rejects_negative_keep_last(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be >= 0"):
        apply_retention(tmp_path, keep_last=-1)


def test_manifest_json_round_trip_is_exact() -> None:
    manifest = Manifest(step=3, created_at="2025-01-01T00:00:00+00:00", files=[], extra={"k": [1, 2]})
    assert Manifest.from_json(manifest.to_json(), source="x") == manifest
    assert manifest.total_bytes == 0


def test_atomic_write_gives_the_mode_open_would_not_mkstemps_0600(tmp_path: Path) -> None:
    # A job's result is written on a Ray node (one user) and read by Airflow's worker (another user) through a
    # shared folder: a 0600 file there failed every heavy task in the podman stack with a PermissionError.
    old = os.umask(0o027)
    try:
        atomic_write_local(tmp_path / "result.json", b"{}")
        (tmp_path / "plain.json").write_bytes(b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "result.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "result.json").stat().st_mode) == stat.S_IMODE(
        (tmp_path / "plain.json").stat().st_mode
    )
