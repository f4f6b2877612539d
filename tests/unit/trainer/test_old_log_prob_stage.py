"""When the trainer runs the separate old-log-prob stage, and the rollout-vs-actor probability diff."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.config import derive_batch_plan, load_config
from rlhf_ops.trainer.metrics import (
    ROLLOUT_DIFF_MAX,
    ROLLOUT_DIFF_MEAN,
    compute_rollout_probs_diff,
    rollout_probs_diff_stats,
)
from rlhf_ops.trainer.ppo_trainer import needs_old_log_prob


@pytest.mark.parametrize(
    ("overrides", "needed"),
    [
        # tiny-cpu: 16 prompts per step, mini-batches of 8 -> 2 optimizer steps: the second is off-policy.
        ([], True),
        (["actor.ppo_mini_batch_size=16"], False),  # one epoch of one mini-batch: on-policy
        (["actor.ppo_mini_batch_size=16", "algorithm.ppo_epochs=2"], True),
        # KL in the reward reads old_log_probs before the update (GAE needs no critic change here).
        (
            ["actor.ppo_mini_batch_size=16", "algorithm.use_kl_in_reward=true", "algorithm.use_kl_loss=false"],
            True,
        ),
    ],
)
def test_old_log_prob_stage_runs_only_when_the_update_is_off_policy(overrides: list[str], needed: bool) -> None:
    config = load_config("tiny-cpu", overrides)
    assert needs_old_log_prob(config.algorithm, derive_batch_plan(config).actor) is needed


def test_mergeable_rollout_diff_stats_match_the_driver_metric() -> None:
    # probs: rollout (0.5, 0.2, 0.9 masked), actor (0.4, 0.25, 0.1): |diff| = 0.1, 0.05 -> max 0.1, sum 0.15.
    rollout = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    actor = torch.tensor([[math.log(0.4), math.log(0.25), math.log(0.1)]])
    mask = torch.tensor([[1, 1, 0]])
    top, total, count = rollout_probs_diff_stats(rollout, actor, mask)
    assert top.item() == pytest.approx(0.1, abs=1e-6) and total.item() == pytest.approx(0.15, abs=1e-6)
    assert count.item() == 2
    driver = compute_rollout_probs_diff(rollout, actor, mask)
    assert driver[ROLLOUT_DIFF_MAX] == pytest.approx(top.item(), abs=1e-6)
    assert driver[ROLLOUT_DIFF_MEAN] == pytest.approx(total.item() / count.item(), abs=1e-6)
    top, total, count = rollout_probs_diff_stats(rollout, actor, torch.zeros_like(mask))
    assert (top.item(), total.item(), count.item()) == (0.0, 0.0, 0.0)
