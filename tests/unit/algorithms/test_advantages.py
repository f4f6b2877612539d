"""Tests for rlhf_ops.algorithms.advantages: every estimator against hand-derived values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ops.algorithms import (
    ADVANTAGE_ESTIMATORS,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    masked_whiten,
    needs_critic,
)
from rlhf_ops.config.validate import GROUP_ESTIMATORS

# ---------------------------------------------------------------- GAE

REWARDS = torch.tensor([[0.0, 0.0, 1.0]])
VALUES = torch.tensor([[0.1, 0.2, 0.3]])
FULL = torch.ones(1, 3)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    # t=2: delta = 1 - 0.3 = 0.7 -> A = 0.7
    # t=1: delta = 0 + 0.3 - 0.2 = 0.1 -> A = 0.1 + 0.7 = 0.8
    # t=0: delta = 0 + 0.2 - 0.1 = 0.1 -> A = 0.9 ; returns = A + V = 1 everywhere
    adv, ret = compute_gae_advantage_return(REWARDS, VALUES, FULL, 1.0, 1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.8, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_with_discount_and_lambda():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45)
    # t=2: delta = 0.7, A = 0.7
    # t=1: delta = 0.9 * 0.3 - 0.2 = 0.07, A = 0.07 + 0.45 * 0.7 = 0.385
    # t=0: delta = 0.9 * 0.2 - 0.1 = 0.08, A = 0.08 + 0.45 * 0.385 = 0.25325
    adv, ret = compute_gae_advantage_return(REWARDS, VALUES, FULL, gamma=0.9, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.25325, 0.385, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[0.35325, 0.585, 1.0]]))


def test_gae_skips_masked_observation_tokens():
    # mask [1, 0, 1]: t=1 is skipped, so t=0 bootstraps from t=2's value and GAE.
    # t=2: A = 0.7 ; t=1 (masked): carries A = 0.7 ; t=0: delta = 0.3 - 0.1 = 0.2, A = 0.2 + 0.7 = 0.9
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = compute_gae_advantage_return(REWARDS, VALUES, mask, 1.0, 1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.7, 0.7]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.9, 1.0]]))


def test_gae_whitens_advantages_by_default_but_not_returns():
    # raw A = [0.9, 0.8, 0.7]: mean 0.8, unbiased std 0.1 -> whitened [1, 0, -1]
    adv, ret = compute_gae_advantage_return(REWARDS, VALUES, FULL, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, -1.0]]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_gae_lam_gamma_one_zero_values_equals_reward_to_go(lengths: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    t_max = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (t_max - n) for n in lengths], dtype=torch.float64)
    # Rewards on padding are arbitrary: GAE must ignore them.
    rewards = torch.randn(len(lengths), t_max, generator=gen, dtype=torch.float64)
    values = torch.zeros_like(rewards)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0, whiten=False)
    reward_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(adv, reward_to_go)
    torch.testing.assert_close(ret, reward_to_go)


# ---------------------------------------------------------------- group estimators


def _outcome_rewards(scores: list[float], lengths: list[int], t_max: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Score on the last valid token of each right-padded response."""
    rewards = torch.zeros(len(scores), t_max)
    mask = torch.zeros(len(scores), t_max)
    for i, (score, n) in enumerate(zip(scores, lengths, strict=True)):
        rewards[i, n - 1] = score
        mask[i, :n] = 1.0
    return rewards, mask


GROUP_INDEX = ["a", "a", "b", "b", "c"]
GROUP_SCORES = [1.0, 0.0, 2.0, 2.0, 5.0]
GROUP_LENGTHS = [3, 2, 1, 3, 2]


@pytest.mark.parametrize(
    "index",
    [
        GROUP_INDEX,
        np.array(GROUP_INDEX, dtype=object),
        [10, 10, 20, 20, 30],
        torch.tensor([10, 10, 20, 20, 30]),
    ],
    ids=["list-str", "numpy-object", "list-int", "tensor"],
)
def test_grpo_normalises_by_group_std(index):
    # a: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> +-0.5 / (0.70711 + 1e-6) = +-0.70711
    # b: 2, 2 -> std 0 -> 0 / 1e-6 = 0 ; c: single sample -> mean 0, std 1 -> 5 / (1 + 1e-6)
    rewards, mask = _outcome_rewards(GROUP_SCORES, GROUP_LENGTHS)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected_scalar = torch.tensor([a, -a, 0.0, 0.0, 5.0 / (1.0 + 1e-6)])
    torch.testing.assert_close(adv, expected_scalar.unsqueeze(-1) * mask)
    assert torch.equal(adv, ret)


def test_dr_grpo_does_not_divide_by_std():
    # a: 1 - 0.5, 0 - 0.5 ; b: 0, 0 ; c: 5 - 0
    rewards, mask = _outcome_rewards(GROUP_SCORES, GROUP_LENGTHS)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, GROUP_INDEX, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 5.0]).unsqueeze(-1) * mask)


def test_group_index_length_must_match_batch():
    rewards, mask = _outcome_rewards(GROUP_SCORES, GROUP_LENGTHS)
    with pytest.raises(ValueError, match="one uid per row"):
        compute_grpo_outcome_advantage(rewards, mask, GROUP_INDEX[:4])


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 5), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
    norm=st.booleans(),
)
def test_grpo_advantages_sum_to_zero_per_group(sizes: list[int], seed: int, norm: bool):
    gen = torch.Generator().manual_seed(seed)
    index = [g for g, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(len(index), generator=gen).tolist()  # groups need not be contiguous
    index = [index[p] for p in perm]
    rewards = torch.zeros(len(index), 2, dtype=torch.float64)
    rewards[:, -1] = torch.randint(-3, 4, (len(index),), generator=gen).double()  # ties happen, like 0/1 rewards
    mask = torch.ones_like(rewards)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    group = torch.tensor(index)
    for g in range(len(sizes)):
        assert math.isclose(adv[group == g, 0].sum().item(), 0.0, abs_tol=1e-6)


def test_rloo_uses_leave_one_out_mean():
    # group a: 1, 0, 2 (n = 3): A_i = s_i - mean(others) -> 1 - 1 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5
    # group c: one sample keeps its raw score 5
    rewards, mask = _outcome_rewards([1.0, 0.0, 2.0, 5.0], [3, 3, 2, 1])
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, ["a", "a", "a", "c"])
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 5.0]).unsqueeze(-1) * mask)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    # a: 1, 3 -> mean 2 -> -1, +1 ; b: single 4 -> mean 0 -> 4. Tiled over T = 2 (full masks):
    # six values -1, -1, 1, 1, 4, 4: mean 4/3; squared deviations 2 * (49 + 1 + 64) / 9 = 228/9,
    # unbiased var (228/9) / 5 = 76/15 -> A = (x - 4/3) / sqrt(76/15)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.0, 4.0]])
    mask = torch.ones(3, 2)
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "b"])
    std = math.sqrt(76 / 15)
    expected = torch.tensor([(-1 - 4 / 3) / std, (1 - 4 / 3) / std, (4 - 4 / 3) / std]).unsqueeze(-1).expand(3, 2)
    torch.testing.assert_close(adv, expected)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_discounts_and_whitens():
    # gamma 0.5: returns [0.25, 0.5, 1]; mean 7/12, unbiased var = sum of (x - 7/12)^2 / 2
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, FULL, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]]))
    mean = 7 / 12
    std = math.sqrt(((0.25 - mean) ** 2 + (0.5 - mean) ** 2 + (1 - mean) ** 2) / 2)
    torch.testing.assert_close(adv, (torch.tensor([[0.25, 0.5, 1.0]]) - mean) / std)


def test_reinforce_plus_plus_resets_after_eos():
    # mask [1, 1, 0]: the reward 7 on padding is not the model's -> return 0 there; t=1: 1, t=0: 0.5 * 1
    # whitened over the two valid tokens [0.5, 1]: mean 0.75, std sqrt(0.125) -> [-0.7071, 0.7071], pad 0
    rewards = torch.tensor([[0.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.5, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]]))


def test_remax_subtracts_greedy_baseline():
    # returns = reward-to-go on valid tokens: [2, 2, 0] ; advantages = returns - 0.5 on valid tokens
    rewards = torch.tensor([[0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, torch.tensor([0.5]), mask)
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.5, 0.0]]))


def test_estimators_do_not_track_gradients():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones(2, 2), ["a", "a"])
    assert not adv.requires_grad


# ---------------------------------------------------------------- registry


def test_estimator_table_and_helpers():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    }
    assert ADVANTAGE_ESTIMATORS["grpo"] is compute_grpo_outcome_advantage
    # the config's rollout.n >= 2 rule knows which estimators compare the samples of one prompt
    assert sorted(GROUP_ESTIMATORS) == ["grpo", "reinforce_plus_plus_baseline", "rloo"]
    assert GROUP_ESTIMATORS <= set(ADVANTAGE_ESTIMATORS)
    assert [n for n in ADVANTAGE_ESTIMATORS if needs_critic(n)] == ["gae"]


def test_unknown_estimator_name_lists_valid_ones():
    with pytest.raises(ValueError, match="adv_estimator='ppo'.*'grpo'"):
        needs_critic("ppo")


def test_whitening_helper_matches_gae_default():
    # The default GAE path is exactly masked_whiten of the raw advantages.
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    raw, _ = compute_gae_advantage_return(REWARDS, VALUES, mask, 1.0, 0.9, whiten=False)
    adv, _ = compute_gae_advantage_return(REWARDS, VALUES, mask, 1.0, 0.9)
    torch.testing.assert_close(adv, masked_whiten(raw, mask))
