"""Resume correctness of real training runs (issue 4): kill-and-resume, epoch boundary, resharding,
remote resume from S3 (moto), corrupted checkpoints.

Every run is the real entrypoint (``python -m workers.entrypoints.train --preset tiny-cpu``) in a
subprocess, attached to the session's Ray cluster with ``--ray-address`` (a second local cluster costs
~40 s on 2 cores). Metrics come from each run's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.checkpoint.manager import CheckpointManager, CorruptCheckpointError
from rlhf_ops.config import dump_config, load_config
from rlhf_ops.storage.manifest import read_latest, read_manifest
from tests.support.moto_server import MotoServer, running_moto_server

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

RUN_TIMEOUT_S = 240
# 32 prompts / 16 per batch = 2 steps per epoch; 2 epochs = 4 steps, checkpoints at steps 2 and 4.
# Step 2 is the last step of epoch 0: resuming from it must train epoch 1 (verl once exited 0 there).
# The resolved config is frozen into one YAML file per module (the ``preset`` fixture), so every run
# of the module trains the same configuration even if the shipped preset changes meanwhile.
COMMON = [
    "trainer.total_epochs=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console,jsonl]",
    "trainer.total_training_steps=null",
    "trainer.save_freq=2",
    "data.val_files=[]",
    "data.toy_rows=32",
    "data.train_batch_size=16",
]
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean")
BUCKET = "ckpt-resume"
REMOTE = f"trainer.remote_store_url=s3://{BUCKET}/runs"


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    """``tiny-cpu`` with ``COMMON``, resolved once and written to a YAML file the runs load."""
    path = tmp_path_factory.mktemp("preset") / "resume.yaml"
    path.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON])))
    return str(path)


def _command(root: Path, preset: str, ray_address: str, overrides: list[str]) -> list[str]:
    entry = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, "--ray-address", ray_address]
    return [*entry, f"trainer.checkpoint_root={root}", *overrides]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # Own session: the whole process group is SIGKILLed at once, like a lost node.
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    proc = _start(cmd, log, env)
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"training run timed out after {RUN_TIMEOUT_S} s; log {log}:\n{_tail(log)}")


def _tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def _records(run_dir: Path, *, skip: int = 0) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[skip:] if line.strip()]


def _train(
    root: Path, preset: str, ray_address: str, overrides: list[str], *, env: dict[str, str] | None = None
) -> Path:
    """Runs to completion (asserting exit 0) and returns the run folder."""
    log = root / "train.log"
    root.mkdir(parents=True, exist_ok=True)
    rc = _run(_command(root, preset, ray_address, overrides), log, _env(env))
    assert rc == 0, f"training exited {rc}; log {log}:\n{_tail(log)}"
    return root / "tiny-cpu" / "demo"


def _assert_same_metrics(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> float:
    """Same steps, same metrics within 1e-5; returns the largest absolute difference seen."""
    assert [r["step"] for r in got] == [r["step"] for r in want]
    worst = 0.0
    for mine, ref in zip(got, want, strict=True):
        for key in COMPARED:
            diff = abs(mine[key] - ref[key])
            worst = max(worst, diff)
            assert diff <= 1e-5 * max(1.0, abs(ref[key])), (mine["step"], key, mine[key], ref[key])
    return worst


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with running_moto_server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, preset: str, ray_address: str, moto: MotoServer) -> Path:
    """An uninterrupted 4-step run on 2 ranks, its checkpoints synced to S3 in the background."""
    root = tmp_path_factory.mktemp("reference")
    start = time.monotonic()
    run_dir = _train(root, preset, ray_address, [REMOTE], env=moto.env())
    print(f"reference run: {time.monotonic() - start:.1f} s")
    return run_dir


def _wait_for_commit(run_dir: Path, step: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    name = f"global_step_{step}"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if (run_dir / name / "MANIFEST.json").exists() and read_latest(run_dir) == step:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before committing {name}:\n{_tail(log)}")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no commit of {name} within {RUN_TIMEOUT_S} s:\n{_tail(log)}")


@pytest.mark.slow  # two runs (~50 s here); the mid-epoch kill-and-resume tests stay in the default suite
def test_killed_at_an_epoch_boundary_checkpoint_resumes_into_the_next_epoch_like_an_uninterrupted_run(
    tmp_path: Path, preset: str, ray_address: str, reference: Path
) -> None:
    cmd = _command(tmp_path, preset, ray_address, [])
    log = tmp_path / "train.log"
    run_dir = tmp_path / "tiny-cpu" / "demo"
    proc = _start(cmd, log, _env())
    try:
        _wait_for_commit(run_dir, 2, proc, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything else in its session, at once
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "global_step_4").exists(), "the run reached step 4 before the kill: nothing was tested"
    state = json.loads((run_dir / "global_step_2" / "trainer_state.json").read_text())
    assert state["loader"] == {"epoch": 0, "position": 2}  # epoch 0 fully consumed
    logged_before_kill = len(_records(run_dir))  # 2, or 3 if step 3 finished in the few ms before the kill

    start = time.monotonic()
    assert _run(cmd, log, _env()) == 0, _tail(log)  # the same command: resume_mode=auto is the default
    print(f"resumed run: {time.monotonic() - start:.1f} s")
    resumed = _records(run_dir, skip=logged_before_kill)
    # Exactly steps 3 and 4, both in epoch 1: nothing repeated, nothing skipped, no silent exit.
    assert [(r["step"], r["training/epoch"]) for r in resumed] == [(3, 1.0), (4, 1.0)]
    worst = _assert_same_metrics(_records(run_dir)[:2] + resumed, _records(reference))
    print(f"largest |resumed - uninterrupted| over {COMPARED}: {worst:.3g}")
    assert read_latest(run_dir) == 4
    final = json.loads((run_dir / "global_step_4" / "trainer_state.json").read_text())
    assert final["global_step"] == 4 and final["loader"] == {"epoch": 1, "position": 2}


@pytest.fixture(scope="module")
def one_rank_from_remote(
    tmp_path_factory: pytest.TempPathFactory, preset: str, ray_address: str, moto: MotoServer, reference: Path
) -> Path:
    """A fresh node (no local run folder) resuming the reference run from S3 on 1 rank, for steps 5 and 6."""
    root = tmp_path_factory.mktemp("from_remote")
    # 3 epochs = 6 steps; stop after step 5 (mid-epoch 2) so that the 1 -> 2 test resumes mid-epoch.
    overrides = [REMOTE, "resources.nproc_per_node=1", "trainer.total_epochs=3", "trainer.total_training_steps=5"]
    return _train(root, preset, ray_address, overrides, env=moto.env())


def test_remote_resume_downloads_the_newest_checkpoint_verifies_it_and_continues(
    one_rank_from_remote: Path, reference: Path, moto: MotoServer
) -> None:
    run_dir = one_rank_from_remote
    downloaded = read_manifest(run_dir / "global_step_4")
    assert downloaded.files == read_manifest(reference / "global_step_4").files  # same bytes, file by file
    assert not (run_dir / "global_step_2").exists()  # only the newest complete checkpoint is fetched
    # 2 ranks -> 1 rank: the 2-rank shards loaded and training went on from step 5, in epoch 2.
    assert [(r["step"], r["training/epoch"]) for r in _records(run_dir)] == [(5, 2.0)]
    assert sorted(p.name for p in (run_dir / "global_step_5" / "actor").glob("*.distcp")) == ["__0_0.distcp"]
    objects = moto.client().list_objects_v2(Bucket=BUCKET)["Contents"]
    assert "runs/tiny-cpu/demo/global_step_5/MANIFEST.json" in {o["Key"] for o in objects}
    assert moto.client().get_object(Bucket=BUCKET, Key="runs/tiny-cpu/demo/latest")["Body"].read() == b"global_step_5"


def test_a_one_rank_checkpoint_resumes_on_two_ranks_mid_epoch(
    tmp_path: Path, preset: str, ray_address: str, one_rank_from_remote: Path
) -> None:
    ckpt = one_rank_from_remote / "global_step_5"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["loader"] == {"epoch": 2, "position": 1}
    overrides = ["trainer.total_epochs=3", f"trainer.resume_mode={ckpt}"]
    run_dir = _train(tmp_path, preset, ray_address, overrides)
    records = _records(run_dir)
    assert [(r["step"], r["training/epoch"]) for r in records] == [(6, 2.0)]
    assert all(abs(records[0][k]) < 1e3 for k in COMPARED), records[0]  # finite, sane values
    final = json.loads((run_dir / "global_step_6" / "trainer_state.json").read_text())
    assert final["loader"] == {"epoch": 2, "position": 2}


def test_a_corrupted_shard_fails_resume_naming_the_file(tmp_path: Path, reference: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shard = run_dir / "global_step_4" / "actor" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 can tell
    shard.write_bytes(bytes(data))
    manager = CheckpointManager(run_dir, roles={}, resume_mode="auto")
    with pytest.raises(CorruptCheckpointError) as info:
        manager.maybe_resume(None)  # type: ignore[arg-type]  # verification fails before any state is read
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("actor/__1_0.distcp: sha256 mismatch")
    assert "actor/__1_0.distcp" in str(info.value)


def _node_local(root: Path, run_name: str) -> list[str]:
    """``rlhf train`` overrides: no shared root, one node folder per rank (two disks), the S3 store."""
    return [
        REMOTE,
        "trainer.shared_checkpoint_root=false",
        f"trainer.node_checkpoint_root={root}/node{{rank}}",
        f"trainer.run_name={run_name}",
    ]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.slow  # two training runs besides the reference: 41 s on a quiet machine, 2-3x under load
def test_without_a_shared_root_each_rank_uploads_its_shards_and_empty_roots_resume_exactly(
    tmp_path: Path, preset: str, ray_address: str, moto: MotoServer, reference: Path
) -> None:
    import hashlib

    client = moto.client()
    first = tmp_path / "first"
    _train(first / "driver", preset, ray_address, _node_local(first, "node-local"), env=moto.env())
    run_dir = first / "driver" / "tiny-cpu" / "node-local"
    _assert_same_metrics(_records(run_dir), _records(reference))  # saving this way changes nothing in training
    # The store: both ranks' shards, rank 0's metadata and scheduler, the driver's state; hashes of the real bytes.
    prefix = "runs/tiny-cpu/node-local"
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/global_step_2/MANIFEST.json")["Body"].read())
    listed = {f["path"]: f for f in manifest["files"]}
    assert set(listed) == {
        "actor/.metadata", "actor/__0_0.distcp", "actor/__1_0.distcp", "actor/lr_scheduler.json", "trainer_state.json",
    }  # fmt: skip
    for path, entry in listed.items():
        data = client.get_object(Bucket=BUCKET, Key=f"{prefix}/global_step_2/{path}")["Body"].read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["size"], entry["sha256"]), path
    assert client.get_object(Bucket=BUCKET, Key=f"{prefix}/latest")["Body"].read() == b"global_step_4"
    # Where the shards were: each rank's own node folder (emptied after the upload), never the driver's.
    log = (first / "driver" / "train.log").read_text()
    for rank, count in ((0, 3), (1, 1)):
        where = f"{first}/node{rank}/tiny-cpu/node-local/global_step_2"
        assert f"[actor] rank {rank} wrote {count} file(s)" in log and f"in {where}, uploaded" in log, rank
    assert _files(first / "node0") == _files(first / "node1") == []
    assert _files(run_dir) == ["metrics.jsonl", "resolved_config.yaml"]

    # Empty roots elsewhere (a new driver and two new nodes) resume step 2 from the store and train 3 and 4.
    second = tmp_path / "second"
    resume = [*_node_local(second, "node-local-2"), f"trainer.resume_mode=s3://{BUCKET}/{prefix}/global_step_2"]
    _train(second / "driver", preset, ray_address, resume, env=moto.env())
    resumed = _records(second / "driver" / "tiny-cpu" / "node-local-2")
    assert [(r["step"], r["training/epoch"]) for r in resumed] == [(3, 1.0), (4, 1.0)]
    _assert_same_metrics(resumed, _records(reference)[2:])
    for rank in (0, 1):  # each node downloaded and verified its own copy before loading it
        node_copy = second / f"node{rank}" / "tiny-cpu" / "node-local-2" / "global_step_2"
        assert read_manifest(node_copy).model_dump()["files"] == manifest["files"]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="runs/tiny-cpu/node-local-2/")["Contents"]}
    assert "runs/tiny-cpu/node-local-2/global_step_4/MANIFEST.json" in keys
