"""SIGKILL of a run's whole process group: nothing the run started stays alive, and the resumed run loses and
repeats no optimizer step.

The default case is a driver that starts processes the way a local Ray cluster does (a child in the driver's
group, workers in process groups of their own, a grandchild), killed with ``killpg``. The slow case kills the
real ``rlhf train`` (local Ray cluster) at a random step and resumes it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_ops.process_reaper import REAP_ENV, processes_with_token
from tests.reliability.conftest import Figures

BOUND_S = 5.0

DRIVER = r"""
import os, subprocess, sys, time
from rlhf_ops.process_reaper import start_run_reaper
token = start_run_reaper()
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
spawn = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)"
spawn_more = [sys.executable, "-c", spawn, *sleep]
procs = [subprocess.Popen(sleep)]                                               # like gcs_server: same group
procs += [subprocess.Popen(sleep, start_new_session=True) for _ in range(2)]    # like Ray workers: own group
procs += [subprocess.Popen(spawn_more, start_new_session=True)]                 # a worker with a child of its own
print(token, flush=True)
time.sleep(600)
"""


def _session(sid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True, check=True).stdout
    return [int(p) for p, s, stat in (line.split() for line in out.splitlines()) if int(s) == sid and stat[0] != "Z"]


def _wait_gone(token: str, sid: int, bound_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if not processes_with_token(token) and not _session(sid):
            return time.monotonic() - start
        time.sleep(0.02)
    pytest.fail(f"alive {bound_s} s after the kill: token {processes_with_token(token)}, session {_session(sid)}")


def test_killing_the_process_group_leaves_no_process_of_the_run(tmp_path: Path, figures: Figures) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not the run's: kept
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env[REAP_ENV] = "inherited"  # a token from a parent run: the driver must get (and watch) its own
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    token = (driver.stdout.readline() if driver.stdout else "").strip()
    try:
        assert token and token != "inherited", "the driver did not start its own reaper"
        deadline = time.monotonic() + 30
        # The 5 processes it started (the driver's own /proc environ is from before it set the token).
        while len(processes_with_token(token)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = processes_with_token(token)
        assert len(started) == 5, started
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its group; the workers are in groups of their own
        driver.wait(timeout=10)
        seconds = _wait_gone(token, driver.pid, BOUND_S)
        assert bystander.poll() is None  # processes without the run's token are never touched
    finally:
        bystander.kill()
        for pid in processes_with_token(token) if token else []:
            os.kill(pid, signal.SIGKILL)
    figures.record(kills=1, processes_started=len(started), alive_after_kill=0, seconds_to_clean=round(seconds, 3))


def _records(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _train(root: Path, overrides: list[str], *, preset: str = "tiny-cpu") -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "train", "--preset", preset, f"trainer.checkpoint_root={root}"]
    log = (root / "train.log").open("ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    env.pop(REAP_ENV, None)
    return subprocess.Popen([*cmd, *overrides], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlhf_train_killed_at_a_random_step_resumes_with_no_lost_or_repeated_step(
    tmp_path: Path, figures: Figures
) -> None:
    steps = 6
    kill_after = random.Random(15).randrange(2, steps)  # a step after the first checkpoint (save_freq=2)
    overrides = [f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=0"]
    overrides += ["trainer.val_before_train=false", "trainer.logger=[console,jsonl]", "data.val_files=[]"]
    run_dir = tmp_path / "tiny-cpu" / "demo"
    proc = _train(tmp_path, overrides)
    deadline = time.monotonic() + 900
    while len(_records(run_dir)) < kill_after:
        assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    token = _run_token(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    seconds = _wait_gone(token, proc.pid, BOUND_S)
    from rlhf_ops.storage.manifest import read_latest

    committed = read_latest(run_dir) or 0
    logged = len(_records(run_dir))
    resumed = _train(tmp_path, overrides)
    assert resumed.wait(timeout=900) == 0, (tmp_path / "train.log").read_text()[-3000:]
    new_steps = [int(r["step"]) for r in _records(run_dir)[logged:]]  # type: ignore[call-overload]
    # The final model saw steps 1..committed from the checkpoint and committed+1..steps after the resume.
    assert new_steps == list(range(committed + 1, steps + 1)), (committed, new_steps)
    state = json.loads((run_dir / f"global_step_{steps}" / "trainer_state.json").read_text())
    assert state["global_step"] == steps
    figures.record(
        kill_at_step=logged, resumed_from=committed, lost_steps=0, repeated_steps=0, seconds_to_clean=seconds
    )


def _run_token(sid: int) -> str:
    """The reaper token the run's processes inherited (read from the raylet and workers of its session)."""
    for pid in _session(sid):
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for line in environ:
            if line.startswith(f"{REAP_ENV}="):
                return line.split("=", 1)[1]
    raise AssertionError(f"no process of session {sid} carries {REAP_ENV}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlhf_train_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
    tmp_path: Path, figures: Figures
) -> None:
    """A real SIGKILL between a checkpoint's shards and its manifest: SmolLM2's save (weights and AdamW state,
    ~1.6 GB) lasts long enough to be caught with shards on disk and no ``MANIFEST.json`` yet."""
    from rlhf_ops.storage.manifest import MANIFEST_NAME, read_latest

    steps = 3
    overrides = [f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.test_freq=0"]
    overrides += ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "rollout.max_new_tokens=8"]
    overrides += ["trainer.logger=[console,jsonl]", "trainer.run_name=demo"]
    run_dir = tmp_path / "smollm2-135m-grpo-cpu" / "demo"
    proc = _train(tmp_path, overrides, preset="smollm2-135m-grpo-cpu")
    partial = run_dir / "global_step_2"
    deadline = time.monotonic() + 1200
    # Step 1's checkpoint is complete, step 2's shards are being written, its manifest is not there yet.
    while not (
        (run_dir / "global_step_1" / MANIFEST_NAME).exists()
        and any(f.stat().st_size > 0 for f in partial.rglob("*.distcp") if f.is_file())
        and not (partial / MANIFEST_NAME).exists()
    ):
        assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
        assert time.monotonic() < deadline and not (partial / MANIFEST_NAME).exists(), "the save was not caught"
        time.sleep(0.01)
    token = _run_token(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    seconds = _wait_gone(token, proc.pid, BOUND_S)
    assert not (partial / MANIFEST_NAME).exists()  # killed mid-save: shards without a manifest
    shards = sum(1 for f in partial.rglob("*") if f.is_file())
    assert read_latest(run_dir) == 1
    logged = len(_records(run_dir))
    assert logged == 2  # steps 1 and 2 trained; step 2's checkpoint was cut short

    resumed = _train(tmp_path, overrides, preset="smollm2-135m-grpo-cpu")
    assert resumed.wait(timeout=1200) == 0, (tmp_path / "train.log").read_text()[-3000:]
    log = (tmp_path / "train.log").read_text()
    new_steps = [int(r["step"]) for r in _records(run_dir)[logged:]]  # type: ignore[call-overload]
    assert new_steps == [2, 3], new_steps  # step 2 retrained from step 1's checkpoint, 0 lost, none twice committed
    # The resume says which checkpoint it skipped and which it took.
    assert re.search(r"skipping \S*global_step_2: incomplete", log), log[-3000:]
    assert re.search(r"resumed from \S*global_step_1 \(step 1\)", log), log[-3000:]
    assert (partial / MANIFEST_NAME).exists() and read_latest(run_dir) == steps
    figures.record(
        killed_in_save_of_step=2, shard_files_at_kill=shards, resumed_from=1, lost_steps=0, seconds_to_clean=seconds
    )
