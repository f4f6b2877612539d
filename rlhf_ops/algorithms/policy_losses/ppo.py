"""PPO's clipped surrogate (verl ``vanilla``) and GSPO's sequence-level ratio (verl numerics).

Shape notation: B: batch size (of this micro-batch), T: response length; every token-level input is (B, T).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_ops.algorithms.losses import Count, agg_loss, apply_is_weights
from rlhf_ops.algorithms.stats import masked_mean, masked_sum
from rlhf_ops.extensions.algorithms import LossAggMode, policy_loss


@policy_loss("vanilla", description="Token-level PPO clip.")
def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    norm_len: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual-clip (verl ``vanilla``).

    ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``; per token
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``, and for
    ``A < 0`` it is further capped at ``-A * clip_ratio_c`` (dual-clip, arXiv:1912.09729), which bounds the
    loss of tokens whose ratio exploded.

    Args:
        old_log_prob: (B, T) log-probs of the policy that generated the batch.
        log_prob: (B, T) log-probs of the current policy (carries the gradient).
        advantages: (B, T).
        response_mask: (B, T).
        clip_ratio_low: Lower clip epsilon (ratio >= 1 - clip_ratio_low).
        clip_ratio_high: Upper clip epsilon (ratio <= 1 + clip_ratio_high).
        clip_ratio_c: Dual-clip bound for negative advantages; > 1.
        loss_agg_mode: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        global_num_tokens: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        global_num_seqs: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        norm_len: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        is_weights: (B, T) detached per-token weights multiplying the token losses before aggregation
            (truncated importance sampling against the rollout engine,
            :func:`rlhf_ops.algorithms.rollout_correction.truncated_is_weights`).

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (tokens where the clipped term won),
        ``actor/pg_clipfrac_lower`` (tokens capped by the dual clip) and ``actor/ppo_kl`` (mean of
        ``old_log_prob - log_prob``).

    Raises:
        ValueError: If ``clip_ratio_c <= 1`` or ``loss_agg_mode`` is unknown.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1.0, got {clip_ratio_c}.")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean((torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).float(), response_mask)
    pg_losses = apply_is_weights(torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), is_weights)
    pg_loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach(),
        "actor/ppo_kl": ppo_kl.detach(),
    }
    return pg_loss, metrics


@policy_loss("gspo", description="Sequence-level ratio.")
def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "seq-mean-token-mean",
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    norm_len: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO loss (arXiv:2507.18071): clipping on the sequence-level importance ratio.

    ``s_i = exp(mean_t(log_prob - old_log_prob))`` over the valid tokens of sequence i (the geometric
    mean of the token ratios). Per token ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is
    ``s_i`` and its gradient that of the token log-prob scaled by ``s_i`` (log of it clamped at 10, as
    verl). The loss is the PPO clipped surrogate on ``s_it`` (no dual clip).

    Args:
        old_log_prob: (B, T).
        log_prob: (B, T) carries the gradient.
        advantages: (B, T).
        response_mask: (B, T).
        clip_ratio_low: Lower clip epsilon on ``s_i`` (GSPO uses small values, e.g. 3e-4).
        clip_ratio_high: Upper clip epsilon on ``s_i`` (e.g. 4e-4).
        clip_ratio_c: Unused (no dual clip in GSPO); accepted so all ``POLICY_LOSSES`` share one call.
        loss_agg_mode: See :func:`rlhf_ops.algorithms.losses.agg_loss`; GSPO's paper uses ``seq-mean-token-mean``.
        global_num_tokens: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        global_num_seqs: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        norm_len: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        is_weights: See :func:`rlhf_ops.algorithms.policy_losses.ppo.compute_policy_loss`.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower`` (always 0) and
        ``actor/ppo_kl``.
    """
    del clip_ratio_c
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1)  # (B,)
    seq_log_ratio = masked_sum(negative_approx_kl, response_mask, axis=-1) / seq_lengths  # (B,)
    # Stop-gradient trick: value log s_i, gradient d log pi(y_t) per token. (B,) -> (B, 1) broadcasts over T.
    log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = apply_is_weights(torch.maximum(pg_losses1, pg_losses2), is_weights)
    pg_loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    metrics = {
        "actor/pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask).detach(),
        "actor/pg_clipfrac_lower": torch.zeros((), device=pg_loss.device),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }
    return pg_loss, metrics
