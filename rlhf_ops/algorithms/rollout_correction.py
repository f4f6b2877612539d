"""Rollout importance sampling (verl's ``algorithm.rollout_correction``, decoupled mode; ``tis_imp_ratio_cap``).

Shape notation: B: rows of this micro-batch, T: response length; every token-level input is (B, T).

The rollout was sampled by ``pi_rollout`` (the engine: its kernels, and with one-step off-policy pipelining
the weights of one update earlier); PPO's ratio is taken against ``pi_old`` (the actor's recompute, the
proximal policy) and knows nothing of ``pi_rollout``. Each token loss is weighted by a detached, truncated
ratio ``w = min(pi_old / pi_rollout, cap)`` (Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training"; Liu et al. 2025, "When Speed Kills Stability"):

- ``token``: per token, ``w_t = min(exp(old_t - rollout_t), cap)`` (biased, low variance; TIS).
- ``sequence``: per row, ``w = min(exp(sum_t (old_t - rollout_t)), cap)`` over its valid tokens, on every
  valid token of the row (the full likelihood ratio of the response; unbiased before the cap).

Log-ratios are clamped to [-20, 20] before ``exp`` (verl's safety bound), so one wild token cannot give inf.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rlhf_ops.algorithms.stats import masked_mean

__all__ = ["rollout_is_weights", "truncated_is_weights"]

_BOUND = 20.0


def rollout_is_weights(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    level: Literal["token", "sequence"],
    threshold: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights of the rollout policy against the actor's old policy.

    Args:
        old_log_prob: (B, T) the actor's log-probs of the sampled tokens (``old_log_probs``).
        rollout_log_probs: (B, T) the rollout engine's log-probs of the same tokens.
        response_mask: (B, T) 1 on the model's tokens (observation tokens of multi-turn rows are 0).
        level: ``"token"`` or ``"sequence"`` (module docstring).
        threshold: The cap (> 0).

    Returns:
        ``(weights, metrics)``: weights (B, T), detached, 0 on masked tokens. Metrics (verl's names, means over
        this call's valid tokens; a sequence weight counts once per token of its row):
        ``rollout_corr/rollout_is_mean`` (before the cap), ``rollout_corr/rollout_is_ratio_fraction_high``
        (share above the cap), ``rollout_corr/kl`` (mean of ``rollout - old``, k1 of KL(pi_rollout || pi_old)).

    Raises:
        ValueError: ``threshold <= 0``, an unknown ``level``, or shapes that differ.
    """
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}.")
    if not old_log_prob.shape == rollout_log_probs.shape == response_mask.shape:
        raise ValueError(
            f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same (B, T) shape."
        )
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = (old_log_prob - rollout_log_probs).detach() * mask  # 0 on masked tokens
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-_BOUND, _BOUND))
    elif level == "sequence":
        seq = log_ratio.sum(dim=-1, keepdim=True).clamp(-_BOUND, _BOUND)  # (B, 1): log of the product over tokens
        raw = torch.exp(seq).expand_as(log_ratio)
    else:
        raise ValueError(f"rollout_is={level!r}: choose 'token' or 'sequence'.")
    weights = raw.clamp(max=threshold) * mask
    metrics = {
        "rollout_corr/rollout_is_mean": masked_mean(raw, response_mask),
        "rollout_corr/rollout_is_ratio_fraction_high": masked_mean((raw > threshold).to(raw.dtype), response_mask),
        "rollout_corr/kl": masked_mean(-log_ratio, response_mask),
    }
    return weights, metrics


def truncated_is_weights(
    old_log_prob: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, *, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token ``min(exp(old_log_prob - rollout_log_probs), cap)`` (verl's ``tis_imp_ratio_cap``).

    Args:
        old_log_prob: (B, T) the trainer's log-probs of the sampled tokens (the PPO behaviour policy).
        rollout_log_probs: (B, T) the rollout engine's log-probs of the same tokens.
        response_mask: (B, T).
        cap: Upper bound of the weight (verl's recipes: 2).

    Returns:
        ``(weights, metrics)``: weights (B, T), detached, 0 on masked tokens; metrics ``actor/tis_weight_mean``
        (mean weight before the cap), ``actor/tis_clipfrac`` (share of tokens capped), local masked means.

    Raises:
        ValueError: ``cap <= 0``.
    """
    if cap <= 0:
        raise ValueError(f"tis_imp_ratio_cap must be > 0, got {cap}.")
    raw = torch.exp(torch.clamp(old_log_prob - rollout_log_probs, min=-20.0, max=20.0)).detach()
    weights = torch.clamp(raw, max=cap) * response_mask.to(raw.dtype)
    metrics = {
        "actor/tis_weight_mean": masked_mean(raw, response_mask),
        "actor/tis_clipfrac": masked_mean((raw > cap).float(), response_mask),
    }
    return weights, metrics
