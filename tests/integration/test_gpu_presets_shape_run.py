"""Each GPU preset's shape run (rlhf_ops.config.shape_run) trains 2 steps on 2 CPU ranks with the real model.

The shape run keeps the preset's reward function, data format (GSM8K via ``builtin:gsm8k_synth``), estimator,
KL placement, vLLM rollout, dynamic batch size, remove padding, HSDP and activation checkpointing; it shrinks
the hardware and the batch (see the helper's docstring). A preset whose ``reward_fn`` does not exist, whose
estimator needs a role the launcher does not start, or whose batch settings do not split fails here.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.support.real_model import smollm2_path
from tests.support.shape_run import shape_run_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# What each preset's run must show in its metrics: the estimator's own losses and the KL placement.
EXPECTED = {
    "qwen2.5-0.5b-grpo-gpu": ("actor/pg_loss", "actor/kl_loss"),  # GRPO, KL as a loss, no critic
    # GAE + critic, KL in the reward (verl's metric names)
    "qwen2.5-7b-ppo-gpu": ("actor/pg_loss", "critic/vf_loss", "actor/reward_kl_penalty_coeff"),
}


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_gpu_preset_shape_run_trains_two_steps(preset: str, tmp_path: Path) -> None:
    from rlhf_ops.rewards import load_reward_fn
    from workers.entrypoints.train import run_training

    model_dir = smollm2_path()
    config = shape_run_config(preset, model_path=model_dir, checkpoint_root=str(tmp_path))
    try:
        load_reward_fn(config.reward.reward_fn)
    except (ValueError, ImportError) as exc:  # the gsm8k reward lands with the reward library (issue 9)
        pytest.fail(f"{preset}: reward.reward_fn={config.reward.reward_fn!r} does not load: {exc}")
    start = time.perf_counter()
    run_training(config)
    print(f"{preset} shape run: 2 steps in {time.perf_counter() - start:.0f} s")
    run_dir = tmp_path / config.trainer.experiment_name / config.trainer.run_name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        for key in EXPECTED[preset]:
            assert math.isfinite(row[key]), (key, row)
        assert 0.0 <= row["critic/score/mean"] <= 1.0  # gsm8k scores are 0 / 1
        assert 0 < row["response_length/mean"] <= 16
    assert (run_dir / "global_step_2" / "MANIFEST.json").exists()  # the end-of-run checkpoint committed
