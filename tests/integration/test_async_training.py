"""``trainer.pipeline=async`` end to end: tiny-cpu GRPO through Ray, one FSDP2 actor rank and a rollout group of
its own (one worker process, hf engine, partial rollout every token), weights through the object store; killed
after the step-2 checkpoint and started again: the pending batches are kept or generated again, never both.

The run is the real entrypoint in a subprocess attached to the session's Ray cluster.
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

RUN_TIMEOUT_S = 600
COMMON = [
    "trainer.pipeline=async",
    "trainer.async_rollout.max_staleness=1",
    "trainer.async_rollout.num_cpus_per_worker=0.5",
    "trainer.async_rollout.partial_rollout_tokens=1",
    "resources.nproc_per_node=1",
    "resources.num_cpus_per_worker=1",
    "trainer.total_epochs=2",
    "trainer.total_training_steps=null",
    "trainer.save_freq=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.logger=[console,jsonl]",
    "data.val_files=[]",
    "data.toy_rows=24",  # 3 steps per epoch, 6 in all: the buffer admits across the epoch boundary
    "data.train_batch_size=8",
    "rollout.n=4",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _records(run_dir: Path, *, skip: int = 0) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[skip:] if line.strip()]


@pytest.mark.slow  # two runs of the entrypoint (~3-5 min on 2 loaded cores)
def test_async_run_bounds_the_lag_and_a_killed_run_keeps_its_buffer(
    tmp_path: Path, tiny_model_dir: str, ray_address: str
) -> None:
    preset = tmp_path / "async.yaml"
    preset.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *COMMON])))
    entry = [sys.executable, "-m", "workers.entrypoints.train", "--preset", str(preset), "--ray-address", ray_address]
    cmd = [*entry, f"trainer.checkpoint_root={tmp_path}"]
    log, run_dir = tmp_path / "train.log", tmp_path / "tiny-cpu" / "demo"
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not ((run_dir / "global_step_2" / "MANIFEST.json").exists() and read_latest(run_dir) == 2):
            assert proc.poll() is None, f"exited ({proc.returncode}) before step 2:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no step-2 checkpoint:\n{log.read_text()[-4000:]}"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    before = _records(run_dir)
    assert [r["step"] for r in before][:2] == [1, 2]
    for row in before:
        assert row["training/policy_lag_max"] <= 1.0 and math.isfinite(row["actor/pg_loss"])
        assert 0.0 <= row["async/rollout_idle_frac"] <= 1.0 and 0.0 <= row["async/trainer_idle_frac"] <= 1.0
    state = json.loads((run_dir / "global_step_2" / "trainer_state.json").read_text())
    pending = state["pipeline"]["batches"]
    # Depth 2 (max_staleness + 1): after update 2 the batches of steps 3 and 4 are admitted, finished or not.
    assert [b["step"] for b in pending] == [3, 4]
    # Step 3's batch was admitted after update 1, a whole step before the save: finished and kept (the save takes
    # in what the workers finished); step 4's, admitted just before the save, may still be in flight.
    assert pending[0]["tensors"] is not None
    kept_expected = 32 * sum(b["tensors"] is not None for b in pending)
    rc = subprocess.run(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=_env(), timeout=RUN_TIMEOUT_S)
    assert rc.returncode == 0, log.read_text()[-4000:]
    resumed = _records(run_dir, skip=len(before))
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    first = resumed[0]
    # Two pending batches of 8 prompts x 4 samples: each kept or generated again, once.
    assert first["async/resume_kept_rows"] + first["async/resume_regenerated_rows"] == 64
    assert first["async/resume_kept_rows"] == kept_expected
    assert all(r["async/resume_kept_rows"] == 0 for r in resumed[1:])


@pytest.mark.slow  # one run of the entrypoint with a vLLM engine in the rollout worker (~2-3 min here)
def test_async_run_with_a_vllm_rollout_worker_trains_with_bounded_lag(
    tmp_path: Path, tiny_model_dir: str, ray_address: str
) -> None:
    overrides = [
        f"model.path={tiny_model_dir}",
        *COMMON,
        "trainer.total_epochs=1",  # 3 steps
        "trainer.async_rollout.partial_rollout_tokens=4",
        "rollout.engine=vllm",
        "rollout.kv_cache_memory_bytes=67108864",
    ]
    preset = tmp_path / "async_vllm.yaml"
    preset.write_text(dump_config(load_config("tiny-cpu", overrides)))
    entry = [sys.executable, "-m", "workers.entrypoints.train", "--preset", str(preset), "--ray-address", ray_address]
    log, run_dir = tmp_path / "train.log", tmp_path / "tiny-cpu" / "demo"
    with log.open("ab") as out:
        rc = subprocess.run(
            [*entry, f"trainer.checkpoint_root={tmp_path}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
            timeout=RUN_TIMEOUT_S,
        )
    assert rc.returncode == 0, log.read_text()[-4000:]
    rows = _records(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["training/policy_lag_max"] <= 1.0 and math.isfinite(row["actor/pg_loss"])
        assert row["response_length/mean"] > 0 and row["async/rollout_tokens_per_s"] >= 0
    # A step whose batch was finished before the previous one ended sees no new tokens; the run as a whole does.
    assert max(r["async/rollout_tokens_per_s"] for r in rows) > 0


def test_the_rollout_group_runs_as_ray_actors_with_object_store_weights(tiny_model_dir: str) -> None:
    """The Ray path of the group (the unit tests run it in-process): actors outside any placement group, the state
    dict through one ray.put, a request held until its weights arrive."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_ops.padding import compute_position_ids
    from rlhf_ops.protocol import DataProto
    from rlhf_ops.sampling import SamplingParams
    from workers.rollout.async_group import AsyncRolloutGroup
    from workers.rollout.async_rollout_worker import RolloutWorkerSpec

    config = load_config("tiny-cpu", ["rollout.max_new_tokens=3"])
    spec = RolloutWorkerSpec(
        model_path=tiny_model_dir,
        rollout=config.rollout,
        pad_token_id=0,
        eos_token_id=(2,),
        max_prompt_length=4,
        seed=3,
    )
    group = AsyncRolloutGroup.launch(spec, num_workers=1, num_cpus=0.25)
    try:
        ids = torch.tensor([[0, 5, 6], [0, 5, 6]])
        mask = (ids != 0).long()
        prompts = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)}
        )
        sampling = SamplingParams(temperature=1.0, response_length=3, eos_token_id=(2,), pad_token_id=0)
        assert group.submit(1, prompts, sampling, n=2, min_version=1, front=False) == 1
        assert group.poll(0.5) == []  # held: the worker has version 0
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        group.push_weights({k: v * 1.5 for k, v in model.state_dict().items()}, 1)
        found = []
        deadline = time.monotonic() + 60
        while not found and time.monotonic() < deadline:
            found = group.poll(1.0)
        assert [(b, p, len(d)) for b, p, d in found] == [(1, 0, 2)]
        assert found[0][2].tensors["token_policy_version"].max().item() == 1
        assert group.stats()[0]["version"] == 1.0
    finally:
        group.shutdown()
