"""SIGKILL of ``rlhf sync`` in the middle of a remote upload (moto S3, the real HTTP path): the remote store never
shows a checkpoint without its manifest, and the next sync completes what the killed one left half done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_ops.storage import find_latest_remote
from rlhf_ops.storage.manifest import MANIFEST_NAME, read_latest, verify_checkpoint, write_manifest
from rlhf_ops.storage.stores import open_store
from tests.reliability.conftest import Figures
from tests.reliability.test_storage_faults import _violations
from tests.support.fault_proxy import FaultProxy
from tests.support.moto_server import MotoServer, running_moto_server

STEPS = 3
FILES = {f"actor/model/shard_{i}.distcp": 30_000 for i in range(4)} | {"trainer_state.json": 2}


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with running_moto_server() as server:
        yield server


def _run_dir(root: Path) -> Path:
    for step in range(1, STEPS + 1):
        ckpt = root / f"global_step_{step}"
        for rel, size in FILES.items():
            (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / rel).write_bytes(os.urandom(size))
        write_manifest(ckpt, step=step)
    return root


def _sync(local: Path, remote: str, endpoint: str, moto: MotoServer) -> subprocess.Popen[str]:
    env = {**os.environ, **moto.env(), "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "sync", str(local), remote]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )


def test_rlhf_sync_killed_mid_upload_never_shows_a_checkpoint_without_manifest_and_the_next_sync_completes_it(
    moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Figures
) -> None:
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    local = _run_dir(tmp_path / "run")
    bucket = moto.create_bucket(f"kill-{uuid.uuid4().hex[:8]}")
    remote, client, prefix = f"s3://{bucket}/run", moto.client(), "run/"
    stop, seen = threading.Event(), []

    def watch() -> None:  # a resuming job or an evaluator reading the store while the upload runs
        while not stop.is_set():
            seen.extend(_violations(client, bucket, prefix))
            time.sleep(0.02)

    def keys() -> list[str]:
        return [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # Every request is slowed down so the kill lands inside the second checkpoint's upload: some of its
        # files are up, its manifest is not (the first checkpoint may be complete already).
        with FaultProxy(moto.endpoint_url, match=lambda method, path: True, delay_s=0.3) as proxy:
            killed = _sync(local, remote, proxy.url, moto)
            deadline = time.monotonic() + 120
            while not any(k.startswith(f"{prefix}global_step_2/actor/") for k in keys()):
                assert killed.poll() is None, killed.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the sync did not reach the second checkpoint"
                time.sleep(0.02)
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait(timeout=30)
        time.sleep(0.5)  # anything in flight has landed
        at_kill = keys()
        partial = [k for k in at_kill if k.startswith(f"{prefix}global_step_2/")]
        assert partial and f"{prefix}global_step_2/{MANIFEST_NAME}" not in at_kill, at_kill
        assert f"{prefix}global_step_{STEPS}/{MANIFEST_NAME}" not in at_kill
        # What a resuming reader sees: at most the first checkpoint, never the half-uploaded second.
        found = find_latest_remote(remote)
        assert found is None or found[0] == 1, found
        # The next sync (no slow-down) completes it.
        resumed = _sync(local, remote, moto.endpoint_url, moto)
        out = resumed.communicate(timeout=300)[0]
        assert resumed.returncode == 0, out[-3000:]
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert seen == [], seen[:5]
    fs, root = open_store(remote)  # the instance that listed the store before the resync: its cache is stale
    assert read_latest(root, fs=fs) == STEPS
    for step in range(1, STEPS + 1):
        assert verify_checkpoint(f"{root}/global_step_{step}", fs=fs, check_hashes=True) == [], step
    figures.record(
        upload_kills=1,
        files_up_at_kill=len(partial),
        upload_checkpoint_without_manifest_seen=len(seen),
        completed_after_resync=STEPS,
    )
