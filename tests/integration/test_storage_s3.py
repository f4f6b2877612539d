"""Checkpoint sync against a real S3 endpoint: moto's server in a subprocess, faults from a real proxy.

Multipart settings: threshold 512 KiB, parts of 256 KiB (moto's minimum part size lowered to 64 KiB),
so the 1.5 MB shard is uploaded in ceil(1_500_000 / 262_144) = 6 parts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.storage import (
    BackgroundSyncer,
    CorruptCheckpointError,
    SyncError,
    apply_remote_retention,
    download_checkpoint,
    find_latest_remote,
    sync_checkpoint,
)
from rlhf_ops.storage.manifest import MANIFEST_NAME, read_manifest, verify_checkpoint, write_manifest
from tests.support.fault_proxy import FaultProxy
from tests.support.moto_server import MotoServer, running_moto_server

pytestmark = pytest.mark.integration

BIG = "model/shard_0.distcp"
MULTIPART: dict[str, Any] = {"multipart_threshold": 512 * 1024, "part_size": 256 * 1024}
ONE_ATTEMPT = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}  # botocore does not retry


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with running_moto_server(part_min_size=64 * 1024) as server:
        yield server


@pytest.fixture
def bucket(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    return moto.create_bucket(f"ckpt-{uuid.uuid4().hex[:12]}")


def make_ckpt(run_dir: Path, step: int) -> Path:
    ckpt = run_dir / f"global_step_{step}"
    files = {BIG: os.urandom(1_500_000), "optim/shard_0.distcp": os.urandom(100_000), "trainer_state.json": b"{}"}
    files["extra/empty.bin"] = b""
    for rel, data in files.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(data)
    write_manifest(ckpt, step=step)
    return ckpt


def keys(moto: MotoServer, bucket: str) -> list[str]:
    listing = moto.client().list_objects_v2(Bucket=bucket)
    return sorted(obj["Key"] for obj in listing.get("Contents", []))


def test_upload_incremental_and_verified_download(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    url = f"s3://{bucket}/exp/run"
    report = sync_checkpoint(ckpt, url, **MULTIPART)
    assert sorted(report.uploaded) == ["extra/empty.bin", BIG, "optim/shard_0.distcp", "trainer_state.json"]
    assert report.latest_updated and report.bytes_uploaded == 1_500_000 + 100_000 + 2
    head = moto.client().head_object(Bucket=bucket, Key=f"exp/run/global_step_1/{BIG}")
    assert head["ETag"].strip('"').endswith("-6")  # multipart, 6 parts
    assert head["Metadata"]["sha256"] == {e.path: e.sha256 for e in read_manifest(ckpt).files}[BIG]
    assert f"exp/run/global_step_1/{MANIFEST_NAME}" in keys(moto, bucket)
    body = moto.client().get_object(Bucket=bucket, Key="exp/run/latest")["Body"].read()
    assert body == b"global_step_1"

    again = sync_checkpoint(ckpt, url, **MULTIPART)
    assert again.uploaded == [] and len(again.skipped) == 4 and not again.manifest_uploaded

    dest = tmp_path / "restore" / "global_step_1"
    download_checkpoint(f"{url}/global_step_1", dest)
    assert verify_checkpoint(dest) == [] and (dest / BIG).read_bytes() == (ckpt / BIG).read_bytes()


@pytest.mark.parametrize(("replacement", "problem"), [(b"x" * 100_000, "sha256 mismatch"), (b"x", "size mismatch")])
def test_corrupt_object_makes_download_raise_naming_the_file(
    moto: MotoServer, bucket: str, tmp_path: Path, replacement: bytes, problem: str
) -> None:
    sync_checkpoint(make_ckpt(tmp_path / "local", 1), f"s3://{bucket}/run", **MULTIPART)
    moto.client().put_object(Bucket=bucket, Key="run/global_step_1/optim/shard_0.distcp", Body=replacement)
    dest = tmp_path / "restore" / "global_step_1"
    with pytest.raises(CorruptCheckpointError) as info:
        download_checkpoint(f"s3://{bucket}/run/global_step_1", dest)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"optim/shard_0.distcp: {problem}")
    assert os.listdir(dest.parent) == []  # nothing placed, no temp folder left


def test_first_faults_on_upload_part_are_retried(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    dest = tmp_path / "restore" / "global_step_1"
    with FaultProxy(moto.endpoint_url, faults=["reset", "500", "503", "reset"]) as proxy:
        options = {"endpoint_url": proxy.url}
        report = sync_checkpoint(ckpt, f"s3://{bucket}/run", storage_options=options, **MULTIPART)
        download_checkpoint(f"s3://{bucket}/run/global_step_1", dest, storage_options=options)  # passes through
    assert proxy.injected == 4 and proxy.matched >= 6 + 4  # 6 parts went through after the 4 faults
    assert report.manifest_uploaded and verify_checkpoint(dest) == []


def test_whole_file_retries_when_request_retries_are_off(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    with FaultProxy(moto.endpoint_url, faults=["500", "500"]) as proxy:
        options: dict[str, Any] = {"endpoint_url": proxy.url, **ONE_ATTEMPT}
        report = sync_checkpoint(
            ckpt, f"s3://{bucket}/run", storage_options=options, part_concurrency=1, backoff_s=0.01, **MULTIPART
        )
    # One part at a time: part 1 fails (attempt 1), part 1 fails again (attempt 2), attempt 3 passes.
    assert report.retries == 2 and proxy.injected == 2 and report.manifest_uploaded


def test_always_failing_parts_raise_and_leave_no_manifest_then_resync_completes(
    moto: MotoServer, bucket: str, tmp_path: Path
) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    url = f"s3://{bucket}/run"
    with FaultProxy(moto.endpoint_url, always="500") as proxy:
        with pytest.raises(SyncError, match="no MANIFEST.json") as info:
            options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"total_max_attempts": 2}}}
            sync_checkpoint(ckpt, url, storage_options=options, retries=1, backoff_s=0.01, **MULTIPART)
    assert list(info.value.failed) == [BIG] and proxy.injected >= 2
    uploaded = keys(moto, bucket)
    assert f"run/global_step_1/{MANIFEST_NAME}" not in uploaded and "run/latest" not in uploaded
    assert find_latest_remote(url) is None

    report = sync_checkpoint(ckpt, url, **MULTIPART)  # straight to moto: finishes the interrupted one
    assert report.uploaded == [BIG] and len(report.skipped) == 3  # vouched for by x-amz-meta-sha256
    assert find_latest_remote(url) == (1, f"{url}/global_step_1")


def test_killed_sync_leaves_no_manifest_and_resync_completes(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "local", 1)
    url = f"s3://{bucket}/run"
    script = (
        "import sys; from rlhf_ops.storage import sync_checkpoint; sync_checkpoint(sys.argv[1], sys.argv[2], "
        "multipart_threshold=512 * 1024, part_size=256 * 1024, part_concurrency=1)"
    )
    with FaultProxy(moto.endpoint_url, delay_s=1.0) as proxy:  # 6 parts x 1 s: slow enough to kill mid-way
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
        child = subprocess.Popen([sys.executable, "-c", script, str(ckpt), url], env=env)
        try:
            deadline = time.monotonic() + 60
            while not (proxy.matched >= 2 and len(keys(moto, bucket)) >= 3):
                assert child.poll() is None and time.monotonic() < deadline, "sync ended before it could be killed"
                time.sleep(0.05)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    assert f"run/global_step_1/{MANIFEST_NAME}" not in keys(moto, bucket)
    report = sync_checkpoint(ckpt, url, **MULTIPART)
    assert report.uploaded == [BIG] and report.manifest_uploaded
    assert find_latest_remote(url, verify_hashes=True) == (1, f"{url}/global_step_1")


def test_background_syncer_blocks_submit_when_the_queue_is_full(moto: MotoServer, bucket: str, tmp_path: Path):
    url = f"s3://{bucket}/run"
    ckpts = [make_ckpt(tmp_path / "local", step) for step in (1, 2, 3)]
    with FaultProxy(moto.endpoint_url, delay_s=0.3) as proxy:  # each checkpoint takes >= 6 x 0.3 s
        options = {"endpoint_url": proxy.url}
        syncer = BackgroundSyncer(url, max_queue=1, storage_options=options, part_concurrency=1, **MULTIPART)
        start = time.monotonic()
        syncer.submit(ckpts[0])  # taken by the uploader
        syncer.submit(ckpts[1])  # waits in the queue
        assert time.monotonic() - start < 1.0
        with pytest.raises(TimeoutError, match="queue still full"):
            syncer.submit(ckpts[2], timeout=0.3)
        syncer.close(timeout=60)
    assert [r.step for r in syncer.reports] == [1, 2]
    assert find_latest_remote(url) == (2, f"{url}/global_step_2")


def test_remote_retention_on_s3(moto: MotoServer, bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/run"
    for step in (1, 2, 3):
        sync_checkpoint(make_ckpt(tmp_path / "local", step), url, **MULTIPART)
    assert apply_remote_retention(url, keep_last=1, protect={1}) == [2]
    remaining = {key.split("/")[1] for key in keys(moto, bucket)}
    assert remaining == {"global_step_1", "global_step_3", "latest"}
    assert find_latest_remote(url) == (3, f"{url}/global_step_3")
