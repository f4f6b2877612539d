"""Tests for rlhf_ops.algorithms.losses: aggregation modes, PPO / GSPO clipping, value loss, invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_ops.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_value_loss,
)

# ---------------------------------------------------------------- agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3 is empty: not a sequence


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # token sums 3 and 4, two non-empty sequences
        ("seq-mean-token-mean", 2.75),  # token means 1.5 and 4
        ("seq-mean-token-sum-norm", 7 / 6),  # (3 / 3 + 4 / 3) / 2 with norm_len = T = 3
    ],
)
def test_agg_loss_local_modes(mode: str, expected: float):
    torch.testing.assert_close(agg_loss(LOSS, MASK, mode), torch.tensor(expected))


def test_seq_mean_token_sum_norm_with_explicit_norm_len():
    # (3 / 2 + 4 / 2) / 2 = 1.75
    torch.testing.assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=2), torch.tensor(1.75))


def test_agg_loss_global_counts_are_divisors():
    # token sum 7 / 7 global tokens ; seq sum 3 + 4 = 7 / 7 global seqs ; mean-of-means 5.5 / 11
    torch.testing.assert_close(agg_loss(LOSS, MASK, "token-mean", global_num_tokens=7), torch.tensor(1.0))
    torch.testing.assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=7), torch.tensor(1.0))
    out = agg_loss(LOSS, MASK, "seq-mean-token-mean", global_num_seqs=torch.tensor(11.0))
    torch.testing.assert_close(out, torch.tensor(0.5))


def test_agg_loss_empty_mask_is_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        torch.testing.assert_close(agg_loss(LOSS, torch.zeros_like(MASK), mode), torch.tensor(0.0))


def test_agg_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="loss_agg_mode='seq-mean'.*'token-mean'"):
        agg_loss(LOSS, MASK, "seq-mean")
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        agg_loss(LOSS, MASK, "token-mean", global_num_tokens=0)
    with pytest.raises(ValueError, match="global_num_seqs must be > 0"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum", global_num_seqs=-1)
    with pytest.raises(ValueError, match="norm_len must be > 0"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=0)


# ---------------------------------------------------------------- PPO policy loss


def _ppo(diff: list[float], adv: list[float], mask: list[float] | None = None, *, clip_ratio_c: float = 3.0):
    """One sequence with old log-probs 0, so log_prob - old = diff; clip range [1 - 0.2, 1 + 0.28]."""
    log_prob = torch.tensor([diff], requires_grad=True)
    mask_t = torch.ones(1, len(diff)) if mask is None else torch.tensor([mask])
    loss, metrics = compute_policy_loss(
        torch.zeros(1, len(diff)),
        log_prob,
        torch.tensor([adv]),
        mask_t,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=clip_ratio_c,
    )
    return loss, metrics, log_prob


def test_ppo_upper_clip_with_asymmetric_range():
    # ratio e^0.5 = 1.6487 > 1.28, A = +1 -> max(-1.6487, -1.28) = -1.28 (clipped, no gradient)
    loss, metrics, log_prob = _ppo([0.5], [1.0])
    torch.testing.assert_close(loss, torch.tensor(-1.28))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(1.0))
    loss.backward()
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, torch.zeros(1, 1))


def test_ppo_lower_clip_only_binds_for_negative_advantage():
    # ratio e^-0.5 = 0.6065 < 0.8. A = +1: max(-0.6065, -0.8) = -0.6065 (unclipped)
    loss, metrics, _ = _ppo([-0.5], [1.0])
    torch.testing.assert_close(loss, torch.tensor(-math.exp(-0.5)))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.0))
    # A = -1: max(0.6065, 0.8) = 0.8 (clipped)
    loss, metrics, _ = _ppo([-0.5], [-1.0])
    torch.testing.assert_close(loss, torch.tensor(0.8))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(1.0))


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 = 7.389, A = -1: max(7.389, 1.28) = 7.389, then min(3 * 1, 7.389) = 3 (dual clip)
    loss, metrics, _ = _ppo([2.0], [-1.0])
    torch.testing.assert_close(loss, torch.tensor(3.0))
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(1.0))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.0))  # 1.28 > 7.389 is false


def test_ppo_mixed_tokens_loss_metrics_and_gradient():
    # tokens: [upper clip -1.28, unclipped -0.6065, lower clip 0.8, dual clip 3.0], padding ignored
    # token-mean = (-1.28 - 0.60653 + 0.8 + 3.0) / 4 = 0.478367
    # only token 2 has a gradient: d(-A * ratio) / dlogp = -ratio = -0.60653, / 4 tokens
    diff = [0.5, -0.5, -0.5, 2.0, 9.0]
    adv = [1.0, 1.0, -1.0, -1.0, 100.0]
    loss, metrics, log_prob = _ppo(diff, adv, [1.0, 1.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(loss, torch.tensor((-1.28 - math.exp(-0.5) + 0.8 + 3.0) / 4))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["actor/ppo_kl"], torch.tensor(-(0.5 - 0.5 - 0.5 + 2.0) / 4))
    assert all(not m.requires_grad for m in metrics.values())
    loss.backward()
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -math.exp(-0.5) / 4, 0.0, 0.0, 0.0]]))


def test_ppo_log_ratio_is_clamped_to_20():
    # diff 30 -> clamped to 20: ppo_kl = -20, loss stays finite (dual clip caps it at 3)
    loss, metrics, _ = _ppo([30.0], [-1.0])
    torch.testing.assert_close(metrics["actor/ppo_kl"], torch.tensor(-20.0))
    torch.testing.assert_close(loss, torch.tensor(3.0))


def test_ppo_rejects_dual_clip_bound_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _ppo([0.0], [1.0], clip_ratio_c=1.0)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_clip_and_gradient():
    # seq 1: log ratios [0.2, 0.4] -> s = e^0.3 = 1.34986 > 1.2, A = +1 -> loss -1.2 per token (clipped)
    # seq 2: log ratios [0.1, -0.1] (+ padding) -> s = e^0 = 1, A = -1 -> loss 1.0 per token
    # seq-mean-token-mean: (-1.2 + 1.0) / 2 = -0.1
    old = torch.zeros(2, 3)
    log_prob = torch.tensor([[0.2, 0.4, 0.0], [0.1, -0.1, 5.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, metrics = compute_policy_loss_gspo(old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    torch.testing.assert_close(loss, torch.tensor(-0.1))
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], torch.tensor(0.5))  # 2 of 4 tokens
    torch.testing.assert_close(metrics["actor/pg_clipfrac_lower"], torch.tensor(0.0))
    torch.testing.assert_close(metrics["actor/ppo_kl"], torch.tensor(-(0.2 + 0.4 + 0.1 - 0.1) / 4))
    loss.backward()
    # seq 2 token grad: -A * s (d s_it / d logp_t = s_it = 1) * 1/2 tokens * 1/2 seqs = 0.25; seq 1 clipped
    assert log_prob.grad is not None
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]]))


def test_gspo_ratio_is_geometric_mean_of_token_ratios():
    # token ratios 2 and 8 -> geometric mean 4; with a huge clip range the loss is -A * 4 = -4
    old = torch.zeros(1, 2)
    log_prob = torch.log(torch.tensor([[2.0, 8.0]]))
    loss, _ = compute_policy_loss_gspo(
        old, log_prob, torch.ones(1, 2), torch.ones(1, 2), clip_ratio_low=0.9, clip_ratio_high=10.0
    )
    torch.testing.assert_close(loss, torch.tensor(-4.0))


def test_policy_loss_table():
    assert POLICY_LOSSES["vanilla"] is compute_policy_loss and POLICY_LOSSES["gspo"] is compute_policy_loss_gspo
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "clip_cov", "kl_cov", "cispo"}


# ---------------------------------------------------------------- value loss and entropy


def test_value_loss_clipping():
    # token 1: v 1.0, V 0.5, R 0.0: clip(1.0, 0.3, 0.7) = 0.7; (1 - 0)^2 = 1 vs 0.49 -> 1.0 (unclipped)
    # token 2: v 1.0, V 0.5, R 2.0: (1 - 2)^2 = 1 vs (0.7 - 2)^2 = 1.69 -> 1.69 (clipped)
    # vf_loss = 0.5 * (1.0 + 1.69) / 2 = 0.6725 ; clipfrac 1/2 ; token 3 is padding
    vpreds = torch.tensor([[1.0, 1.0, 9.0]], requires_grad=True)
    values = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.6725))
    torch.testing.assert_close(metrics["critic/vf_clipfrac"], torch.tensor(0.5))
    loss.backward()
    # token 1: 0.5 * 2 * (1 - 0) / 2 tokens = 0.5 ; token 2's winning term is clipped: no gradient
    assert vpreds.grad is not None
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.5, 0.0, 0.0]]))


# ---------------------------------------------------------------- micro-batch invariance


def _random_split(batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    """A random permutation of the rows cut into random non-empty micro-batches."""
    perm = torch.randperm(batch, generator=gen)
    cuts = sorted(set(torch.randint(1, batch, (batch // 2,), generator=gen).tolist())) if batch > 1 else []
    return list(torch.tensor_split(perm, cuts))


def _random_batch(batch: int, length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.6).double()
    mask[0, 0] = 1.0  # at least one valid token in the whole batch
    global_tokens = mask.sum()
    global_seqs = (mask.sum(-1) > 0).sum()
    return gen, values, mask, global_tokens, global_seqs


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 8), length=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_agg_loss_micro_batches_sum_to_whole_batch(batch: int, length: int, seed: int):
    gen, values, mask, global_tokens, global_seqs = _random_batch(batch, length, seed)
    parts = _random_split(batch, gen)
    for mode in LOSS_AGG_MODES:
        whole = agg_loss(values, mask, mode)
        summed = sum(
            agg_loss(values[p], mask[p], mode, global_num_tokens=global_tokens, global_num_seqs=global_seqs)
            for p in parts
        )
        torch.testing.assert_close(summed, whole, msg=f"mode={mode}")


# Clip-Cov / KL-Cov select tokens by a covariance centred on the call's own tokens (the paper's recipe):
# by design they depend on the split (tests/unit/algorithms/test_policy_losses.py covers them).
SPLIT_DEPENDENT = {"clip_cov", "kl_cov"}


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 8), length=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_policy_losses_micro_batches_sum_to_whole_batch(batch: int, length: int, seed: int):
    gen, adv, mask, global_tokens, global_seqs = _random_batch(batch, length, seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64)
    new = old + 0.5 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    parts = _random_split(batch, gen)
    for name, loss_fn in POLICY_LOSSES.items():
        if name in SPLIT_DEPENDENT:
            continue
        for mode in LOSS_AGG_MODES:
            whole, _ = loss_fn(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
            summed = sum(
                loss_fn(
                    old[p],
                    new[p],
                    adv[p],
                    mask[p],
                    clip_ratio_low=0.2,
                    clip_ratio_high=0.28,
                    loss_agg_mode=mode,
                    global_num_tokens=global_tokens,
                    global_num_seqs=global_seqs,
                )[0]
                for p in parts
            )
            torch.testing.assert_close(summed, whole, msg=f"{name} mode={mode}")
