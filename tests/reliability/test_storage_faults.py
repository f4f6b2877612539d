"""Storage faults: S3 errors, resets and slow answers during many syncs (moto behind a fault-injecting proxy, the
real HTTP path); a full local disk during a save (a size-limited tmpfs); a corrupted or missing ``latest``."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.checkpoint.manager import CheckpointManager, CheckpointWriteError
from rlhf_ops.storage import SyncError, find_latest_remote, sync_checkpoint
from rlhf_ops.storage.manifest import MANIFEST_NAME, read_latest, verify_checkpoint, write_manifest
from tests.reliability.conftest import Figures
from tests.support.fault_proxy import FaultProxy
from tests.support.moto_server import MotoServer, running_moto_server

FILES = {"actor/model/shard_0.distcp": 40_000, "actor/optim/shard_0.distcp": 20_000, "trainer_state.json": 2}
RETRIES = 2


# ---------------------------------------------------------------- S3 faults over many syncs
def _ckpt(run_dir: Path, step: int) -> Path:
    ckpt = run_dir / f"global_step_{step}"
    for rel, size in FILES.items():
        (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / rel).write_bytes(os.urandom(size))
    write_manifest(ckpt, step=step)
    return ckpt


def _violations(client: Any, bucket: str, prefix: str) -> list[str]:
    """A remote checkpoint whose manifest is there but a file is not (or of another size), or ``latest`` naming a
    checkpoint without its manifest. Pointers are read before the listing they are checked against (files go up
    before their manifest, the manifest before ``latest``), so a sync running meanwhile cannot fake a violation."""

    def keys() -> dict[str, int]:
        return {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}

    def read(key: str) -> bytes | None:
        try:
            return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        except client.exceptions.NoSuchKey:
            return None

    latest = read(f"{prefix}latest")
    manifests = {k: read(k) for k in keys() if k.endswith(f"/{MANIFEST_NAME}")}
    sizes = keys()
    problems = []
    for key, body in manifests.items():
        ckpt = key.rsplit("/", 1)[0]
        for entry in json.loads(body)["files"] if body else []:
            got = sizes.get(f"{ckpt}/{entry['path']}")
            if got != entry["size"]:
                problems.append(f"{ckpt}: manifest lists {entry['path']} ({entry['size']} bytes), remote has {got}")
    if latest is not None and f"{prefix}{latest.decode()}/{MANIFEST_NAME}" not in sizes:
        problems.append(f"latest names {latest.decode()}, which has no manifest")
    return problems


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with running_moto_server() as server:
        yield server


def run_faulty_syncs(moto: MotoServer, tmp_path: Path, n: int, *, seed: int, fault_rate: float) -> dict[str, Any]:
    rng = random.Random(seed)
    lock = threading.Lock()

    def matched(method: str, path: str) -> bool:  # every S3 request of the sync may be hit, not only parts
        with lock:
            return rng.random() < fault_rate

    faults = [rng.choice(["reset", "500", "503"]) for _ in range(100_000)]
    bucket = moto.create_bucket(f"faults-{uuid.uuid4().hex[:8]}")
    client, prefix = moto.client(), "run/"
    stop, seen = threading.Event(), []

    def watch() -> None:  # reads the store while the syncs run, as a resuming job or an evaluator would
        while not stop.is_set():
            seen.extend(_violations(client, bucket, prefix))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    ok = failed = retries = 0
    worst_s = 0.0
    with FaultProxy(moto.endpoint_url, faults=faults, match=matched, delay_s=0.02) as proxy:
        options = {"endpoint_url": proxy.url, "config_kwargs": {"retries": {"total_max_attempts": 2}}}
        watcher.start()
        for step in range(1, n + 1):
            ckpt = _ckpt(tmp_path / "local", step)
            start = time.monotonic()
            try:
                report = sync_checkpoint(
                    ckpt, f"s3://{bucket}/run", storage_options=options, retries=RETRIES, backoff_s=0.01
                )
                ok += 1
                retries += report.retries
                assert report.retries <= RETRIES * len(FILES) + RETRIES  # files, then manifest and latest
            except SyncError:
                failed += 1  # the remote checkpoint stays incomplete: the invariant below must still hold
            worst_s = max(worst_s, time.monotonic() - start)
            seen.extend(_violations(client, bucket, prefix))
        stop.set()
        watcher.join(timeout=10)
        requests = proxy.forwarded + proxy.injected
    latest = find_latest_remote(f"s3://{bucket}/run", storage_options={"endpoint_url": moto.endpoint_url})
    assert seen == [], seen[:5]
    assert ok >= n // 2 and latest is not None
    return {
        "syncs": n,
        "succeeded": ok,
        "failed_cleanly": failed,
        "faults_injected": proxy.injected,
        "retries": retries,
        "requests": requests,
        "worst_sync_s": round(worst_s, 2),
        "checkpoint_without_manifest_seen": len(seen),
    }


def test_s3_faults_during_syncs_never_show_a_checkpoint_without_its_manifest(
    moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Figures
) -> None:
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    result = run_faulty_syncs(moto, tmp_path, 12, seed=15, fault_rate=0.15)
    assert result["faults_injected"] > 5 and result["worst_sync_s"] < 300  # a runaway retry loop would not end
    assert result["requests"] < 12 * 40  # ~6 requests a clean sync; retries stay bounded
    figures.record(**result)


@pytest.mark.slow
def test_100_syncs_with_faults(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Figures):
    for key, value in moto.env().items():
        monkeypatch.setenv(key, value)
    result = run_faulty_syncs(moto, tmp_path, 100, seed=1515, fault_rate=0.2)
    assert result["requests"] < 100 * 40
    figures.record(**result)


# ---------------------------------------------------------------- local disk full during a save
class FileRole:
    """A stand-in for a worker group's role: writes ``size`` bytes of shards (what FSDP ranks do on save)."""

    def __init__(self) -> None:
        self.size = 0

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        with open(Path(path) / "shard_0.distcp", "wb") as f:
            for _ in range(self.size // 65536 + 1):
                f.write(os.urandom(65536))

    def load_checkpoint(self, path: str) -> None:
        assert (Path(path) / "shard_0.distcp").is_file()


class StepState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["global_step"])


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_during_a_save_names_the_folder_and_keeps_the_previous_checkpoint(
    small_disk: Path, figures: Figures
) -> None:
    role, trainer = FileRole(), StepState()
    run_dir = small_disk / "exp" / "run"
    manager = CheckpointManager(run_dir, roles={"actor": role})
    role.size, trainer.step = 1_000_000, 1
    manager.save(trainer)  # 1 MB of 4 MB
    role.size, trainer.step = 8_000_000, 2  # does not fit
    with pytest.raises(CheckpointWriteError) as caught:
        manager.save(trainer)
    message = str(caught.value)
    assert f"cannot write checkpoint {run_dir}/global_step_2 (No space left on device)" in message
    assert "previous checkpoint (step 1)" in message and "Fix: free space" in message and "\n" not in message
    assert read_latest(run_dir) == 1 and verify_checkpoint(run_dir / "global_step_1") == []
    assert not (run_dir / "global_step_2").exists()  # the partial one is gone: its space is free again
    role.size, trainer.step = 1_000_000, 3
    manager.save(trainer)  # the run can go on once space is there
    assert read_latest(run_dir) == 3
    resumed = StepState()
    assert CheckpointManager(run_dir, roles={"actor": FileRole()}).maybe_resume(resumed) == 3
    figures.record(disk_full_saves=1, previous_intact=True, latest_unchanged=True)


# ---------------------------------------------------------------- corrupted or missing latest
@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("garbage", "latest is missing or unreadable; resuming from the newest complete checkpoint, step 2"),
        ("missing", "latest is missing or unreadable; resuming from the newest complete checkpoint, step 2"),
        ("names_partial", "latest names step 3; resuming from the newest complete checkpoint, step 2"),
        ("empty", "latest is missing or unreadable; resuming from the newest complete checkpoint, step 2"),
    ],
)
def test_a_corrupted_or_missing_latest_resumes_from_the_newest_complete_checkpoint_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, said: str
) -> None:
    role, trainer = FileRole(), StepState()
    run_dir = tmp_path / "exp" / "run"
    manager = CheckpointManager(run_dir, roles={"actor": role})
    for step in (1, 2):
        role.size, trainer.step = 1000, step
        manager.save(trainer)
    partial = run_dir / "global_step_3" / "actor"  # a save killed between shards and manifest
    partial.mkdir(parents=True)
    (partial / "shard_0.distcp").write_bytes(b"half")
    latest = run_dir / "latest"
    if damage == "garbage":
        latest.write_bytes(b"\xff\x00not a step")
    elif damage == "missing":
        latest.unlink()
    elif damage == "names_partial":
        latest.write_text("global_step_3")
    else:
        latest.write_text("")
    resumed = StepState()
    with caplog.at_level(logging.INFO):
        assert CheckpointManager(run_dir, roles={"actor": FileRole()}).maybe_resume(resumed) == 2
    assert resumed.step == 2 and any(said in record.getMessage() for record in caplog.records), caplog.text
