"""``rollout.mode=async`` end to end: 2 GRPO steps of tiny-cpu through Ray (2 FSDP2 ranks, each with a vLLM
``AsyncLLM`` whose engine core is its own process), the weights synced into the engine processes each step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_ops.config import dump_config, load_config

pytestmark = pytest.mark.integration

OVERRIDES = [
    "rollout.engine=vllm",
    "rollout.mode=async",
    "rollout.kv_cache_memory_bytes=67108864",
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.save_freq=0",
    "trainer.logger=[console,jsonl]",
    "data.val_files=[]",
    "data.toy_rows=64",
]


@pytest.mark.slow  # two AsyncLLM engine cores start (spawned, vLLM imported again) next to the trainer ranks
def test_two_async_rollout_steps_train_with_finite_metrics(
    tmp_path: Path, tiny_model_dir: str, ray_address: str
) -> None:
    preset = tmp_path / "async.yaml"
    preset.write_text(dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}", *OVERRIDES])))
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", str(preset), "--ray-address", ray_address]
    cmd.append(f"trainer.checkpoint_root={tmp_path}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    log = tmp_path / "train.log"
    start = time.perf_counter()
    with log.open("wb") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    print(f"async rollout: 2 steps in {time.perf_counter() - start:.1f} s (with Ray workers and engine start-up)")
    assert rc == 0, f"training exited {rc}; log {log}:\n{log.read_text(errors='replace')[-4000:]}"
    rows = [json.loads(line) for line in (tmp_path / "tiny-cpu" / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "training/rollout_probs_diff_max"):
            assert math.isfinite(float(row[key])), (key, row[key])
        # The engine processes generate with the actor's weights: fp32 CPU, the same bound as the sync engine.
        assert float(row["training/rollout_probs_diff_max"]) < 1e-4, row["training/rollout_probs_diff_max"]
        assert float(row["response_length/mean"]) > 0
