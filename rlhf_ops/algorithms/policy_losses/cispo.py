"""CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance-sampling weight, not the update.

Shape notation: B: batch size (of this micro-batch), T: response length; every token-level input is (B, T).
Per token the gradient is ``-A * sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * grad log_prob``: a token whose
ratio left the range still contributes its (capped) gradient, where PPO would give it none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_ops.algorithms.losses import Count, agg_loss, apply_is_weights
from rlhf_ops.algorithms.stats import masked_mean
from rlhf_ops.extensions.algorithms import LossAggMode, policy_loss


@policy_loss("cispo", description="Clipped, detached importance weight times the log-prob.")
def compute_policy_loss_cispo(
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
    """CISPO: REINFORCE with the importance-sampling weight clipped and detached (MiniMax-M1).

    Per token the loss is ``-A * sg(w) * exp(log_prob - sg(log_prob))`` with
    ``w = clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)``: its value is ``-A * w`` (comparable to PPO's
    surrogate) and its gradient ``-A * w * grad log_prob`` (the paper's). MiniMax-M1 tunes only the upper
    bound; a ``clip_ratio_low >= 1`` leaves the weight unbounded below.

    Args:
        old_log_prob: (B, T).
        log_prob: (B, T) carries the gradient.
        advantages: (B, T).
        response_mask: (B, T).
        clip_ratio_low: Lower bound epsilon of the weight.
        clip_ratio_high: Upper bound epsilon of the weight.
        clip_ratio_c: Unused (no dual clip); accepted so all ``POLICY_LOSSES`` share one call.
        loss_agg_mode: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        global_num_tokens: See ``agg_loss``.
        global_num_seqs: See ``agg_loss``.
        norm_len: See ``agg_loss``.
        is_weights: See :func:`rlhf_ops.algorithms.losses.compute_policy_loss`.

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (tokens whose weight hit the upper bound),
        ``actor/pg_clipfrac_lower`` (the lower bound) and ``actor/ppo_kl``.
    """
    del clip_ratio_c
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl).detach()
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    # exp(x - sg(x)) is 1 in value and has the gradient of x: value -A * w, gradient -A * w * d log_prob.
    pg_losses = apply_is_weights(-advantages * weight * torch.exp(log_prob - log_prob.detach()), is_weights)
    pg_loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio > 1 + clip_ratio_high).float(), response_mask).detach(),
        "actor/pg_clipfrac_lower": masked_mean((ratio < 1 - clip_ratio_low).float(), response_mask).detach(),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }
    return pg_loss, metrics
