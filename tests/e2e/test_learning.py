"""A policy trained from a random init visibly learns the built-in toy task (issue 3).

``copy_digit``: prompt ``"copy: 7"``, reward 1.0 for answering ``7`` and stopping, 0.5 for starting
with ``7``, else 0 (a random policy over 84 tokens scores ~0.01). Runs the real entrypoint on the
session's Ray cluster: 2 gloo FSDP2 ranks, HF rollout, the tiny-cpu preset.

Measured here (2 cores): GRPO mean score 0.014 -> 0.475 over 100 steps (~95% of samples start with
the prompt's digit); PPO (GAE, critic, KL in the
reward) see the test's message. The thresholds leave a wide margin below what was measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_ops.config import load_config
from workers.entrypoints.train import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("ray_cluster")]


def _train(tmp_path: Path, overrides: list[str]) -> list[dict[str, float]]:
    common = [
        f"trainer.checkpoint_root={tmp_path}",
        "trainer.logger=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
    ]
    config = load_config("tiny-cpu", [*common, *overrides])
    run_training(config)
    metrics = tmp_path / config.trainer.experiment_name / config.trainer.run_name / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, config.trainer.total_training_steps + 1))  # no step lost or repeated
    return rows


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_grpo_with_kl_loss_learns_to_copy(tmp_path: Path) -> None:
    rows = _train(tmp_path, [])
    first, last = _mean(rows[:5], "critic/score/mean"), _mean(rows[-5:], "critic/score/mean")
    assert first < 0.1 and last > 0.35, f"GRPO mean score {first:.3f} (first 5 steps) -> {last:.3f} (last 5)"
    assert all(r["actor/kl_loss"] >= 0 for r in rows) and rows[-1]["actor/kl_loss"] > 0  # KL as a loss
    # A score of 0.5 is "starts with the prompt's digit": 0.35 means most samples copy it (chance ~0.01).
    # Learning to stop right after it (1.0) comes later: the strict acc metric lags behind the score.
    assert rows[-1]["actor/entropy"] < rows[0]["actor/entropy"]


@pytest.mark.slow  # 65-105 s here; PPO with a critic stays in the default suite through the golden metrics
def test_ppo_with_critic_and_kl_in_reward_learns_to_copy(tmp_path: Path) -> None:
    rows = _train(
        tmp_path,
        ["algorithm.adv_estimator=gae", "algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=true"],
    )
    first, last = _mean(rows[:5], "critic/score/mean"), _mean(rows[-5:], "critic/score/mean")
    assert first < 0.1 and last > 0.3, f"PPO mean score {first:.3f} (first 5 steps) -> {last:.3f} (last 5)"
    assert "critic/vf_loss" in rows[-1] and "critic/vf_explained_var" in rows[-1]
    assert rows[-1]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)  # KL in the reward, fixed beta


# slow (~80 s): vLLM rollout trains by default in test_real_model_learning.py; remove padding and dynamic
# batch size are exact by default in the unit and integration tests
@pytest.mark.slow
def test_tiny_cpu_learns_with_vllm_rollout_remove_padding_and_dynamic_bsz(tmp_path: Path) -> None:
    # The issue-6 configuration: vLLM (CPU build) rollout with in-place weight sync, packed sequences and
    # token-budget micro-batches in the actor.
    rows = _train(
        tmp_path,
        [
            "rollout.engine=vllm",
            "rollout.kv_cache_memory_bytes=67108864",
            "actor.use_remove_padding=true",
            "actor.use_dynamic_bsz=true",
            "actor.ppo_max_token_len_per_gpu=512",
            "actor.log_prob_max_token_len_per_gpu=1024",
        ],
    )
    first, last = _mean(rows[:5], "critic/score/mean"), _mean(rows[-5:], "critic/score/mean")
    assert first < 0.1 and last > 0.3, f"vLLM run mean score {first:.3f} (first 5 steps) -> {last:.3f} (last 5)"
    assert all(r["timing_s/worker/update_weights"] > 0 for r in rows)  # the actor's weights reached vLLM each step
    # ... and vLLM ran exactly them: its token probabilities equal the actor's recompute to fp32 noise.
    assert max(r["training/rollout_probs_diff_max"] for r in rows) < 1e-4
