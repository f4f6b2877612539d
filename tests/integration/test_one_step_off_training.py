"""``trainer.pipeline=one_step_off`` end to end: tiny-cpu GRPO through Ray, 2 FSDP2 ranks, each with a vLLM
``AsyncLLM`` (engine core in its own process) generating step k + 1's batch while step k trains, with verl's
token-level rollout importance sampling; then exact resume: a run killed after the step-2 checkpoint and
started again logs steps 3 and 4 with the uninterrupted run's metrics (the prefetched batch of step 3 is in
the checkpoint: the weights that sampled it are gone).

Both runs are the real entrypoint in a subprocess attached to the session's Ray cluster (the pattern of
``test_checkpoint_resume.py``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rlhf_ops.config import dump_config, load_config
from rlhf_ops.storage.manifest import read_latest

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

RUN_TIMEOUT_S = 1200  # two engine cores spawn per run (vLLM imported again in each): minutes on loaded cores
# 32 prompts / 16 per batch = 2 steps per epoch, 2 epochs = 4 steps; checkpoints at steps 2 and 4.
COMMON = [
    "rollout.engine=vllm",
    "rollout.mode=async",
    "rollout.kv_cache_memory_bytes=67108864",
    "trainer.pipeline=one_step_off",
    "algorithm.rollout_correction.rollout_is=token",
    "trainer.total_epochs=2",
    "trainer.total_training_steps=null",
    "trainer.save_freq=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console,jsonl]",
    "data.val_files=[]",
    "data.toy_rows=32",
    "data.train_batch_size=16",
]
COMPARED = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "response_length/mean",
    "rollout_corr/rollout_is_mean",
    "rollout_corr/kl",
    "training/policy_lag",
)


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    path = tmp_path_factory.mktemp("preset") / "one_step_off.yaml"
    path.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON])))
    return str(path)


def _command(root: Path, preset: str, ray_address: str) -> list[str]:
    entry = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, "--ray-address", ray_address]
    return [*entry, f"trainer.checkpoint_root={root}"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # own session: the whole process group is SIGKILLed at once
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


def _run(cmd: list[str], log: Path) -> None:
    proc = _start(cmd, log)
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"training run timed out after {RUN_TIMEOUT_S} s; log {log}:\n{_tail(log)}")
    assert rc == 0, f"training exited {rc}; log {log}:\n{_tail(log)}"


def _records(run_dir: Path, *, skip: int = 0) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[skip:] if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, preset: str, ray_address: str) -> Path:
    root = tmp_path_factory.mktemp("reference")
    start = time.monotonic()
    _run(_command(root, preset, ray_address), root / "train.log")
    print(f"uninterrupted one_step_off run (4 steps): {time.monotonic() - start:.1f} s")
    return root / "tiny-cpu" / "demo"


@pytest.mark.slow  # 2 runs x 2 async engine cores next to the trainer ranks (~10 min here under load)
def test_pipelined_run_logs_the_lag_and_the_correction_and_a_killed_run_resumes_exactly(
    tmp_path: Path, preset: str, ray_address: str, reference: Path
) -> None:
    rows = _records(reference)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["training/policy_lag"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    for row in rows:
        for key in (*COMPARED, "timing_s/gen", "timing_s/worker/generate_sequences", "perf/throughput"):
            assert math.isfinite(float(row[key])), (row["step"], key, row[key])
        assert 0.5 < row["rollout_corr/rollout_is_mean"] < 2.0, row["rollout_corr/rollout_is_mean"]
    # Step 1 is on-policy up to the engine's fp32 numerics; from step 2 the rollout is one update (lr 1e-3)
    # behind, so the weights move away from 1 (the correction has something to correct).
    assert abs(rows[0]["rollout_corr/kl"]) < 1e-5 < abs(rows[1]["rollout_corr/kl"])
    state = json.loads((reference / "global_step_2" / "trainer_state.json").read_text())
    assert state["pipeline"]["step"] == 3 and state["pipeline"]["weight_version"] == 1
    assert state["loader"] == {"epoch": 0, "position": 2}  # before step 3's prompts (saved as a batch)
    assert json.loads((reference / "global_step_4" / "trainer_state.json").read_text())["pipeline"] is None

    # Killed once the step-2 checkpoint is committed (step 3's rollout is then in flight), started again.
    cmd, log, run_dir = _command(tmp_path, preset, ray_address), tmp_path / "train.log", tmp_path / "tiny-cpu" / "demo"
    proc = _start(cmd, log)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((run_dir / "global_step_2" / "MANIFEST.json").exists() and read_latest(run_dir) == 2):
            assert proc.poll() is None, f"the run exited ({proc.returncode}) before step 2:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"no step-2 checkpoint within {RUN_TIMEOUT_S} s:\n{_tail(log)}"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (run_dir / "global_step_4").exists(), "the run reached step 4 before the kill: nothing was tested"
    logged_before_kill = len(_records(run_dir))
    start = time.monotonic()
    _run(cmd, log)
    print(f"resumed run (steps 3-4): {time.monotonic() - start:.1f} s")
    resumed = _records(run_dir, skip=logged_before_kill)
    assert [r["step"] for r in resumed] == [3, 4]
    worst = 0.0
    for mine, ref in zip(_records(run_dir)[:2] + resumed, rows, strict=True):
        for key in COMPARED:
            diff = abs(mine[key] - ref[key])
            worst = max(worst, diff)
            assert diff <= 1e-5 * max(1.0, abs(ref[key])), (mine["step"], key, mine[key], ref[key])
        # The prefetched batch in the checkpoint is trained once after the resume: no sample dropped or repeated.
        for key in ("samples/step_count", "samples/consumed_total", "samples/consumed_digest"):
            assert mine[key] == ref[key], (mine["step"], key, mine[key], ref[key])
    assert resumed[-1]["samples/consumed_total"] == 4 * 16  # 4 steps of 16 prompts, each counted once
    print(f"largest |resumed - uninterrupted| over {COMPARED}: {worst:.3g}")
