"""Every estimator on a multi-turn response mask with holes (observation tokens inside the response).

Layout of one row, T = 6: ``[m, m, o, o, m, pad]``: two model tokens, a two-token tool output (mask 0,
attended), the model's closing token (EOS, where the score sits) and one padding column. Values are worked
out by hand in the comments.
"""

from __future__ import annotations

import math

import torch

from rlhf_ops.algorithms import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)

HOLES = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
SCORE_AT_EOS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
# Rewards on masked columns are not the model's: estimators must ignore them.
NOISY = torch.tensor([[0.0, 0.0, 9.0, 9.0, 1.0, 7.0]])


def test_gae_crosses_observation_span_without_discount():
    # values [0.1, 0.2, 0.5, 0.5, 0.3, 0]; gamma 0.5, lam 1.
    # t=5 (pad): skipped, A = 0.   t=4: delta = 1 + 0.5 * 0 - 0.3 = 0.7, A = 0.7
    # t=3, t=2 (tool output): skipped, carry A = 0.7 and next value 0.3
    # t=1: delta = 0 + 0.5 * 0.3 - 0.2 = -0.05, A = -0.05 + 0.5 * 0.7 = 0.3
    # t=0: delta = 0 + 0.5 * 0.2 - 0.1 = 0.0, A = 0 + 0.5 * 0.3 = 0.15
    values = torch.tensor([[0.1, 0.2, 0.5, 0.5, 0.3, 0.0]])
    adv, ret = compute_gae_advantage_return(SCORE_AT_EOS, values, HOLES, 0.5, 1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.15, 0.3, 0.7, 0.7, 0.7, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.2, 1.2, 1.0, 0.0]]))
    # Whitened (the trainer's default): statistics over the three model tokens only.
    white, _ = compute_gae_advantage_return(SCORE_AT_EOS, values, HOLES, 0.5, 1.0)
    model = torch.tensor([0.15, 0.3, 0.7])
    expected = (model - model.mean()) / model.std()
    torch.testing.assert_close(white[0, [0, 1, 4]], expected, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_return_reaches_tokens_before_tool_output():
    # gamma 0.5 per model token; rewards 9, 9 on the tool output and 7 on padding are ignored.
    # t=5: 0. t=4: 1. t=3, t=2: carry 1. t=1: 0 + 0.5 * 1 = 0.5. t=0: 0.25.
    # (verl's `running * mask` would reset at t=3 and give t=1 the tool output's 9s instead.)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(NOISY, HOLES, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 1.0, 1.0, 0.0]]))
    # whitened over the model tokens [0.25, 0.5, 1]: mean 7/12, unbiased std over 3 values
    mean = 7 / 12
    std = math.sqrt(((0.25 - mean) ** 2 + (0.5 - mean) ** 2 + (1 - mean) ** 2) / 2)
    a = [(0.25 - mean) / std, (0.5 - mean) / std, (1 - mean) / std]
    torch.testing.assert_close(adv, torch.tensor([[a[0], a[1], 0.0, 0.0, a[2], 0.0]]))


def test_reinforce_plus_plus_contiguous_mask_unchanged():
    # A plain single-turn mask [1, 1, 1, 0]: gamma 0.5 -> [0.25, 0.5, 1, 0] as verl's reset-after-EOS.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    _, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0]]))


def _two_rows() -> tuple[torch.Tensor, torch.Tensor]:
    # Row 0 scores 1 (on its EOS, column 4), row 1 scores 0; row 1's tool output is three tokens long.
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    return rewards, mask


def test_grpo_broadcasts_onto_model_tokens_only():
    # scores [1, 0], mean 0.5, unbiased std sqrt(0.5) -> A = +-0.5 / sqrt(0.5) = +-0.70711
    rewards, mask = _two_rows()
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, ["g", "g"])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0, 0, a, 0], [-a, 0, 0, 0, -a, -a]]))
    assert torch.equal(adv, ret)


def test_rloo_broadcasts_onto_model_tokens_only():
    # n = 2: A = (s - mean) * 2 / 1 -> [+1, -1]
    rewards, mask = _two_rows()
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, ["g", "g"])
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1, 0, 0, 1, 0], [-1.0, 0, 0, 0, -1, -1]]))


def test_reinforce_plus_plus_baseline_whitens_over_model_tokens_only():
    # s - mean = [+0.5, -0.5] on the 3 + 3 model tokens: mean 0, unbiased var 6 * 0.25 / 5 = 0.3
    rewards, mask = _two_rows()
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["g", "g"])
    a = 0.5 / math.sqrt(0.3)
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0, 0, a, 0], [-a, 0, 0, 0, -a, -a]]))


def test_remax_ignores_observation_rewards_and_zeroes_observation_advantages():
    # Masked rewards (9, 9, 7) ignored: reward-to-go [1, 1, 1, 1, 1, 0]; baseline 0.25 -> 0.75 on model tokens
    adv, ret = compute_remax_outcome_advantage(NOISY, torch.tensor([0.25]), HOLES)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0, 0.0, 0.75, 0.0]]))
