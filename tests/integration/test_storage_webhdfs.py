"""Checkpoint sync through fsspec's WebHDFS client against a protocol-level WebHDFS server.

The server (``tests/support/webhdfs_server.py``) speaks the REST protocol, including the NameNode ->
DataNode 307 redirects of CREATE/APPEND/OPEN, over a temp directory. It does not exercise Kerberos,
delegation tokens, permissions, a real NameNode/DataNode, block replication or HA failover.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_ops.storage import (
    CorruptCheckpointError,
    SyncError,
    apply_remote_retention,
    download_checkpoint,
    find_latest_remote,
    sync_checkpoint,
    sync_run_dir,
)
from rlhf_ops.storage.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint, write_manifest
from tests.support.webhdfs_server import WebHDFSServer

pytestmark = pytest.mark.integration

BIG = "model/shard_0.distcp"


@pytest.fixture
def hdfs() -> Iterator[WebHDFSServer]:
    with WebHDFSServer() as server:
        yield server


def make_ckpt(run_dir: Path, step: int) -> Path:
    ckpt = run_dir / f"global_step_{step}"
    # 6 MB: more than fsspec's 5 MiB write block, so the upload takes two APPENDs.
    files = {BIG: os.urandom(6_000_000), "optim/shard_0.distcp": os.urandom(50_000), "trainer_state.json": b"{}"}
    for rel, data in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    write_manifest(ckpt, step=step)
    return ckpt


def test_sync_incremental_and_download(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    url = hdfs.url("/user/rlhf/exp/run")
    report = sync_checkpoint(ckpt, url, backoff_s=0.01)
    assert sorted(report.uploaded) == [BIG, "optim/shard_0.distcp", "trainer_state.json"] and report.latest_updated
    backing = hdfs.local("/user/rlhf/exp/run")
    assert verify_checkpoint(backing / "global_step_1") == [] and (backing / "latest").read_text() == "global_step_1"
    assert not (backing / "global_step_1" / ".sync").exists()
    assert hdfs.op_counts[("datanode", "APPEND")] >= 2 + 2  # BIG needs 2 blocks; each marker/file >= 1

    creates = hdfs.op_counts[("datanode", "CREATE")]
    again = sync_checkpoint(ckpt, url)
    assert again.uploaded == [] and hdfs.op_counts[("datanode", "CREATE")] == creates  # nothing written

    dest = tmp_path / "restore" / "global_step_1"
    download_checkpoint(f"{url}/global_step_1", dest)
    assert verify_checkpoint(dest) == [] and (dest / BIG).read_bytes() == (ckpt / BIG).read_bytes()


def test_failed_datanode_writes_leave_no_manifest_and_resync_resumes(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    url = hdfs.url("/runs/run")
    hdfs.fail_write_paths.add(BIG)
    with pytest.raises(SyncError, match="no MANIFEST.json") as info:
        sync_checkpoint(ckpt, url, retries=1, backoff_s=0.01)
    assert list(info.value.failed) == [BIG]
    remote = hdfs.local("/runs/run/global_step_1")
    assert not (remote / MANIFEST_NAME).exists() and find_latest_remote(url) is None
    shas = {e.path: e.sha256 for e in read_manifest(ckpt).files}
    markers = sorted(p.relative_to(remote).as_posix() for p in (remote / ".sync").rglob("*") if p.is_file())
    # the two files that made it each got a marker after their last byte; BIG got none
    assert markers == [f".sync/{rel}.sha256-{shas[rel]}" for rel in ("optim/shard_0.distcp", "trainer_state.json")]

    hdfs.fail_write_paths.clear()
    report = sync_checkpoint(ckpt, url, backoff_s=0.01)
    assert report.uploaded == [BIG] and sorted(report.skipped) == ["optim/shard_0.distcp", "trainer_state.json"]
    assert verify_checkpoint(remote) == [] and not (remote / ".sync").exists()


def test_corrupt_file_makes_download_raise_naming_it(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    url = hdfs.url("/runs/run")
    sync_checkpoint(make_ckpt(tmp_path / "local", 1), url)
    (hdfs.local("/runs/run/global_step_1/trainer_state.json")).write_bytes(b"[]")
    with pytest.raises(CorruptCheckpointError, match=r"trainer_state.json: sha256 mismatch"):
        download_checkpoint(f"{url}/global_step_1", tmp_path / "restore" / "global_step_1")
    assert os.listdir(tmp_path / "restore") == []


def test_run_sync_resume_scan_and_retention(hdfs: WebHDFSServer, tmp_path: Path) -> None:
    url = hdfs.url("/runs/run")
    for step in (1, 2, 3):
        make_ckpt(tmp_path / "local", step)
    result = sync_run_dir(tmp_path / "local", url)
    assert [r.step for r in result.reports] == [1, 2, 3] and result.latest_step == 3
    assert find_latest_remote(url, verify_hashes=True) == (3, f"{url}/global_step_3")
    assert apply_remote_retention(url, keep_last=1, protect={1}) == [2]
    assert sorted(os.listdir(hdfs.local("/runs/run"))) == ["global_step_1", "global_step_3", "latest"]
