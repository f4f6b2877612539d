"""Stores beyond file/s3/hdfs/webhdfs: any installed fsspec protocol, here ``memory://`` (in-process)."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from rlhf_ops.fs_protocols import known_protocols, store_protocol_problem, unknown_protocol_problem
from rlhf_ops.storage import download_checkpoint, find_latest_remote, sync_checkpoint
from rlhf_ops.storage.manifest import read_latest, verify_checkpoint, write_manifest
from rlhf_ops.storage.stores import open_store

FILES = {"model/shard_0.distcp": b"w" * 3000, "trainer_state.json": b'{"step": 1}'}


def test_memory_store_opens_and_unknown_protocols_are_refused() -> None:
    fs, root = open_store("memory://bucket/exp")
    assert "memory" in fs.protocol and root == "/bucket/exp"
    assert {"memory", "file", "s3", "gs", "webhdfs"} <= set(known_protocols())
    assert unknown_protocol_problem("gs") is None and store_protocol_problem("memory") is None
    problem = store_protocol_problem("nosuch")
    assert problem is not None and "fsspec knows no protocol 'nosuch'" in problem and "\n" not in problem


def test_checkpoint_syncs_to_and_downloads_from_a_memory_store(tmp_path: Path) -> None:
    remote = f"memory://ckpts-{uuid.uuid4().hex}/exp/run"  # the memory store is process-wide: a fresh root
    ckpt = tmp_path / "run" / "global_step_1"
    for rel, data in FILES.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    write_manifest(ckpt, step=1)

    report = sync_checkpoint(ckpt, remote)
    assert sorted(report.uploaded) == sorted(FILES) and report.manifest_uploaded and report.latest_updated
    fs, root = open_store(remote)
    assert read_latest(root, fs=fs) == 1 and verify_checkpoint(f"{root}/global_step_1", fs=fs) == []
    assert fs.cat_file(f"{root}/global_step_1/trainer_state.json") == b'{"step": 1}'

    found = find_latest_remote(remote)
    assert found == (1, f"{remote}/global_step_1")
    manifest = download_checkpoint(found[1], tmp_path / "restored")
    assert manifest.step == 1
    assert (tmp_path / "restored" / "model" / "shard_0.distcp").read_bytes() == FILES["model/shard_0.distcp"]
    fsspec.filesystem("memory").rm(remote.removeprefix("memory://").split("/")[0], recursive=True)


def test_a_registered_protocol_is_accepted_without_code_changes() -> None:
    class ScratchFS(MemoryFileSystem):
        protocol = ("scratchfs",)

    assert store_protocol_problem("scratchfs") is not None
    fsspec.register_implementation("scratchfs", ScratchFS, clobber=True)
    assert store_protocol_problem("scratchfs") is None
    fs, _ = open_store("scratchfs://x/y")
    assert isinstance(fs, ScratchFS)
