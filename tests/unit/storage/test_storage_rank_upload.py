"""A checkpoint uploaded by two writers from two local folders (two nodes) and committed by a third, on a
``file://`` store: the same manifest format and commit rule as ``sync_checkpoint`` (S3: the integration tests)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rlhf_ops.storage import download_checkpoint, find_latest_remote
from rlhf_ops.storage.manifest import MANIFEST_NAME, CorruptCheckpointError, read_latest, verify_checkpoint
from rlhf_ops.storage.rank_upload import commit_remote_checkpoint, discard_remote_manifest, upload_files
from rlhf_ops.storage.sync import MARKER_DIR


def _node(root: Path, files: dict[str, bytes]) -> Path:
    """A node's local ``global_step_2`` folder holding ``files``."""
    ckpt = root / "exp" / "run" / "global_step_2"
    for rel, data in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    return ckpt


def test_two_writers_then_one_commit_give_a_checkpoint_every_reader_accepts(tmp_path: Path) -> None:
    remote = tmp_path / "store" / "exp" / "run"
    url = f"file://{remote}/global_step_2"
    rank0 = {"actor/__0_0.distcp": b"a" * 1000, "actor/.metadata": b"meta"}
    rank1 = {"actor/__1_0.distcp": b"b" * 700}
    node_a, node_b = _node(tmp_path / "node0", rank0), _node(tmp_path / "node1", rank1)
    (node_a / "actor" / "__9_0.distcp").write_bytes(b"another rank's file on this node")  # not listed: not sent
    first = upload_files(node_a, url, list(rank0))
    second = upload_files(node_b, url, list(rank1))
    assert [e.path for e in first] == ["actor/.metadata", "actor/__0_0.distcp"]  # sorted
    assert first[1].size == 1000 and first[1].sha256 == hashlib.sha256(b"a" * 1000).hexdigest()
    # Uploaded, not committed: no manifest, so nothing resumes from it; markers prove each file's hash meanwhile.
    assert not (remote / "global_step_2" / MANIFEST_NAME).exists()
    assert find_latest_remote(f"file://{remote}") is None
    assert (remote / "global_step_2" / MARKER_DIR / "actor").is_dir()
    assert not (remote / "global_step_2" / "actor" / "__9_0.distcp").exists()

    manifest = commit_remote_checkpoint(url, first + second, extra={"roles": ["actor"]})
    assert [e.path for e in manifest.files] == ["actor/.metadata", "actor/__0_0.distcp", "actor/__1_0.distcp"]
    assert (manifest.step, manifest.extra) == (2, {"roles": ["actor"]})
    assert json.loads((remote / "global_step_2" / MANIFEST_NAME).read_text())["files"][2]["size"] == 700
    assert verify_checkpoint(remote / "global_step_2") == []  # every hash matches the bytes on the store
    assert not (remote / "global_step_2" / MARKER_DIR).exists()
    assert read_latest(remote) == 2 and find_latest_remote(f"file://{remote}") == (2, url)
    got = download_checkpoint(url, tmp_path / "elsewhere" / "global_step_2")
    assert got == manifest and (tmp_path / "elsewhere" / "global_step_2" / "actor" / "__1_0.distcp").read_bytes() == (
        b"b" * 700
    )


def test_commit_refuses_a_file_that_is_not_on_the_store_or_is_listed_twice(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store/run/global_step_4"
    node = _node(tmp_path / "node0", {"actor/__0_0.distcp": b"x" * 10})
    entries = upload_files(node, url, ["actor/__0_0.distcp"])
    lost = entries[0].model_copy(update={"path": "actor/__1_0.distcp"})  # a rank that never uploaded
    with pytest.raises(CorruptCheckpointError) as info:
        commit_remote_checkpoint(url, [*entries, lost, entries[0]])
    assert info.value.problems == ["actor/__0_0.distcp: listed by 2 writers", "actor/__1_0.distcp: missing"]
    assert not (tmp_path / "store" / "run" / "global_step_4" / MANIFEST_NAME).exists()
    with pytest.raises(ValueError, match="must end with a global_step_<N> folder"):
        upload_files(node, f"file://{tmp_path}/store/run", ["actor/__0_0.distcp"])


def test_a_step_saved_again_loses_its_manifest_before_any_file_changes(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store/run/global_step_2"
    node = _node(tmp_path / "node0", {"actor/__0_0.distcp": b"old"})
    commit_remote_checkpoint(url, upload_files(node, url, ["actor/__0_0.distcp"]))
    assert discard_remote_manifest(url) is True
    assert not (tmp_path / "store" / "run" / "global_step_2" / MANIFEST_NAME).exists()
    assert discard_remote_manifest(url) is False
