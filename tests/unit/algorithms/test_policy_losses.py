"""Tests for rlhf_ops.algorithms.policy_losses: Clip-Cov, KL-Cov, CISPO and truncated importance sampling.

Every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_ops.algorithms import (
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_kl_cov,
    truncated_is_weights,
)

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}

# One sequence of 4 tokens: A = [2, 0, 0, -2] (mean 0), log_prob = [-1, -2, -2, -3] (mean -2), so the
# centred covariance (A - 0) * (log_prob + 2) is [2 * 1, 0, 0, -2 * -1] = [2, 0, 0, 2].
ADV = torch.tensor([[2.0, 0.0, 0.0, -2.0]])
LOGP = torch.tensor([[-1.0, -2.0, -2.0, -3.0]])
ONES = torch.ones(1, 4)


def _clip_cov(old: torch.Tensor, *, ratio: float, ub: float = 5.0, seed: int = 0):
    log_prob = LOGP.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss_clip_cov(
        old,
        log_prob,
        ADV,
        ONES,
        **CLIP,
        clip_cov_ratio=ratio,
        clip_cov_lb=1.0,
        clip_cov_ub=ub,
        generator=torch.Generator().manual_seed(seed),
    )
    loss.backward()
    assert log_prob.grad is not None
    return loss, metrics, log_prob.grad


def test_clip_cov_drops_the_loss_of_one_high_covariance_token():
    # ratio 1 everywhere (old = log_prob): token losses -A = [-2, 0, 0, 2]. Candidates: cov in (1, 5) ->
    # tokens 0 and 3; int(0.25 * 4) = 1 of them is dropped: loss (0 + 0 + 2) / 4 = 0.5 without token 0,
    # (-2 + 0 + 0) / 4 = -0.5 without token 3. The dropped token has no gradient, the other -A / 4.
    loss, metrics, grad = _clip_cov(LOGP, ratio=0.25)
    dropped = 0 if float(loss.detach()) > 0 else 3
    torch.testing.assert_close(loss, torch.tensor(0.5 if dropped == 0 else -0.5))
    torch.testing.assert_close(metrics["actor/cov_clipfrac"], torch.tensor(0.25))
    assert float(metrics["actor/pg_clipfrac"]) == 0.0
    assert float(grad[0, dropped]) == 0.0 and abs(float(grad[0, 3 - dropped])) == pytest.approx(0.5)
    # The same generator seed picks the same token.
    torch.testing.assert_close(_clip_cov(LOGP, ratio=0.25)[0], loss)


def test_clip_cov_with_a_larger_share_drops_both_and_bounds_exclude():
    # int(0.5 * 4) = 2: both candidates dropped, the remaining losses are 0 -> loss 0.
    loss, metrics, _ = _clip_cov(LOGP, ratio=0.5)
    torch.testing.assert_close(loss, torch.tensor(0.0))
    torch.testing.assert_close(metrics["actor/cov_clipfrac"], torch.tensor(0.5))
    # ub = 1.5 < 2: no candidate, plain surrogate mean(-A) = 0 and nothing dropped.
    loss, metrics, grad = _clip_cov(LOGP, ratio=0.5, ub=1.5)
    torch.testing.assert_close(loss, torch.tensor(0.0))
    assert float(metrics["actor/cov_clipfrac"]) == 0.0
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0, 0.0, 0.5]]))


def test_clip_cov_never_picks_a_token_ppo_already_clipped():
    # Token 0: ratio 2 with A = 2 > 0 is clipped by PPO (loss max(-4, -2 * 1.28) = -2.56), so only token 3
    # is a candidate; share 0.5 asks for 2 tokens, 1 exists: token 3 dropped -> loss -2.56 / 4 = -0.64.
    old = LOGP - torch.tensor([[math.log(2.0), 0.0, 0.0, 0.0]])
    loss, metrics, grad = _clip_cov(old, ratio=0.5)
    torch.testing.assert_close(loss, torch.tensor(-0.64))
    torch.testing.assert_close(metrics["actor/cov_clipfrac"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.25))
    torch.testing.assert_close(grad, torch.zeros(1, 4))  # clipped, zero-advantage, dropped


def test_kl_cov_penalises_the_top_covariance_tokens():
    # log_prob = [-1, -2, -2, -2.5] (mean -1.875): centred [0.875, -0.125, -0.125, -0.625], cov with A =
    # [1.75, 0, 0, 1.25]; top-1 (int(0.25 * 4)) is token 0. old = log_prob - [0.1, 0, 0, 0.2], so
    # |kl| = [0.1, 0, 0, 0.2] and ratio = [e^0.1, 1, 1, e^0.2]. Unclipped surrogate -A * ratio plus 1 * 0.1
    # on token 0: loss = (-2 e^0.1 + 0.1 + 2 e^0.2) / 4.
    log_prob = torch.tensor([[-1.0, -2.0, -2.0, -2.5]])
    old = log_prob - torch.tensor([[0.1, 0.0, 0.0, 0.2]])
    loss, metrics = compute_policy_loss_kl_cov(old, log_prob, ADV, ONES, **CLIP, kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    e1, e2 = math.exp(0.1), math.exp(0.2)
    torch.testing.assert_close(loss, torch.tensor((-2 * e1 + 0.1 + 2 * e2) / 4))
    torch.testing.assert_close(metrics["actor/kl_cov_frac"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["actor/ppo_kl_abs"], torch.tensor(0.3 / 4))
    # Share 0.5: tokens 0 and 3 penalised (+0.1 + 0.2), coefficient 2 doubles the penalty.
    loss2, _ = compute_policy_loss_kl_cov(old, log_prob, ADV, ONES, **CLIP, kl_cov_ratio=0.5, ppo_kl_coef=2.0)
    torch.testing.assert_close(loss2, torch.tensor((-2 * e1 + 2 * e2 + 2 * 0.3) / 4))


def test_cispo_keeps_a_capped_gradient_where_ppo_has_none():
    # ratio [2, 0.5, 1], A [1, -1, 1]; weight clip(ratio, 0.8, 1.28) = [1.28, 0.8, 1].
    # loss -A * w = [-1.28, 0.8, -1] -> token-mean -1.48 / 3; gradient -A * w / 3 on every token.
    old = torch.zeros(1, 3)
    log_prob = torch.log(torch.tensor([[2.0, 0.5, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, metrics = compute_policy_loss_cispo(old, log_prob, adv, torch.ones(1, 3), **CLIP)
    torch.testing.assert_close(loss, torch.tensor(-1.48 / 3))
    loss.backward()
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.28 / 3, 0.8 / 3, -1.0 / 3]]))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(1 / 3))
    # PPO on the same tokens: token 0 (A > 0, ratio 2 > 1.28) and token 1 (A < 0, ratio 0.5 < 0.8) are clipped:
    # no gradient; token 2 gets -1 / 3.
    ppo_logp = log_prob.detach().clone().requires_grad_(True)
    ppo, _ = compute_policy_loss(old, ppo_logp, adv, torch.ones(1, 3), **CLIP)
    ppo.backward()
    assert ppo_logp.grad is not None
    torch.testing.assert_close(ppo_logp.grad, torch.tensor([[0.0, 0.0, -1.0 / 3]]))


def test_truncated_is_weights_cap_the_ratio_to_the_rollout_engine():
    # old - rollout = [0, log 2, log 4] -> raw weights [1, 2, 4], capped at 2 -> [1, 2, 2]; last token masked.
    old = torch.zeros(1, 4)
    rollout = torch.log(torch.tensor([[1.0, 0.5, 0.25, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, metrics = truncated_is_weights(old, rollout, mask, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 2.0, 0.0]]))
    torch.testing.assert_close(metrics["actor/tis_weight_mean"], torch.tensor(7 / 3))
    torch.testing.assert_close(metrics["actor/tis_clipfrac"], torch.tensor(1 / 3))
    # PPO at ratio 1 with A = 1: token losses -1 x [1, 2, 2] -> token-mean -5 / 3.
    loss, _ = compute_policy_loss(old, old, torch.ones(1, 4), mask, **CLIP, is_weights=weights)
    torch.testing.assert_close(loss, torch.tensor(-5 / 3))
    with pytest.raises(ValueError, match="tis_imp_ratio_cap must be > 0"):
        truncated_is_weights(old, rollout, mask, cap=0.0)


def test_variant_arguments_are_checked():
    with pytest.raises(ValueError, match="clip_cov_ratio must be in"):
        compute_policy_loss_clip_cov(LOGP, LOGP, ADV, ONES, **CLIP, clip_cov_ratio=0.0)
    with pytest.raises(ValueError, match="clip_cov_lb"):
        compute_policy_loss_clip_cov(LOGP, LOGP, ADV, ONES, **CLIP, clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio must be in"):
        compute_policy_loss_kl_cov(LOGP, LOGP, ADV, ONES, **CLIP, kl_cov_ratio=1.5)
