"""Loss aggregation, PPO / GSPO policy losses, the clipped value loss and the entropy term (verl numerics).

Shape notation: B: batch size (of this micro-batch), T: response length. Every token-level input is
(B, T); ``response_mask`` is 1 on response tokens. Losses return ``(scalar, metrics)`` where metrics are
detached scalar tensors computed over this micro-batch (local masked means).

Global counts: pass ``global_num_tokens`` (valid tokens) and ``global_num_seqs`` (sequences with at
least one valid token) of the whole mini-batch, summed over all data-parallel ranks and micro-batches.
Each call then returns this micro-batch's *contribution*, so summing the calls (gradient accumulation,
all-reduce of gradients with SUM) gives exactly the whole-batch loss however the batch was split. Left as
``None``, the local counts are used and the result is the plain mean over this micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_ops.algorithms.stats import masked_mean, masked_sum

Count = int | float | Tensor | None

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def _check_count(name: str, value: Count) -> None:
    # Tensors are not checked: reading them would force a device sync on every micro-batch.
    if isinstance(value, int | float) and value <= 0:
        raise ValueError(f"{name} must be > 0 (the count over the whole batch), got {value}.")


def apply_is_weights(token_losses: Tensor, is_weights: Tensor | None) -> Tensor:
    """``token_losses * is_weights`` (both (B, T)); the weights are detached (they carry no gradient)."""
    return token_losses if is_weights is None else token_losses * is_weights.detach()


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    *,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    norm_len: float | None = None,
) -> Tensor:
    """Aggregate a token-level loss matrix into a scalar.

    Modes (sums run over valid tokens; a "sequence" is a row with at least one valid token):
    ``token-mean``: sum of all token losses / number of tokens.
    ``seq-mean-token-sum``: per-sequence token sum, averaged over sequences.
    ``seq-mean-token-mean``: per-sequence token mean, averaged over sequences.
    ``seq-mean-token-sum-norm``: per-sequence token sum / ``norm_len``, averaged over sequences
    (Dr.GRPO's constant normaliser, arXiv:2503.20783).

    Contract: with ``global_num_tokens`` / ``global_num_seqs`` given, the divisor is that global count
    and the result is this micro-batch's contribution: summing ``agg_loss`` over any split of a batch
    into micro-batches equals ``agg_loss`` over the whole batch. With ``None``, local counts are used (a
    plain mean; empty masks give 0, not NaN). ``token-mean`` reads only ``global_num_tokens``; the
    ``seq-*`` modes read only ``global_num_seqs``.

    Args:
        loss_mat: (B, T) per-token loss.
        loss_mask: (B, T) 1 on tokens that count.
        loss_agg_mode: One of ``LOSS_AGG_MODES``.
        global_num_tokens: Valid tokens in the whole batch (all micro-batches and ranks).
        global_num_seqs: Non-empty sequences in the whole batch (all micro-batches and ranks).
        norm_len: Normaliser of ``seq-mean-token-sum-norm``; default ``loss_mat.shape[-1]``. Pass the
            configured max response length when micro-batches are padded to different lengths (dynamic
            batch size), otherwise the contract above does not hold.

    Returns:
        Scalar tensor.

    Raises:
        ValueError: For an unknown ``loss_agg_mode`` or a non-positive count or ``norm_len``.
    """
    _check_count("global_num_tokens", global_num_tokens)
    _check_count("global_num_seqs", global_num_seqs)
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        num_tokens = mask.sum().clamp(min=1) if global_num_tokens is None else global_num_tokens
        return masked_sum(loss_mat, mask) / num_tokens
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is unknown; valid values: {list(LOSS_AGG_MODES)}.")

    tokens_per_seq = mask.sum(dim=-1)  # (B,)
    seq_mask = (tokens_per_seq > 0).to(loss_mat.dtype)  # (B,) rows with no valid token do not count
    seq_losses = masked_sum(loss_mat, mask, axis=-1)  # (B,) token sums
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / tokens_per_seq.clamp(min=1)
    num_seqs = seq_mask.sum().clamp(min=1) if global_num_seqs is None else global_num_seqs
    loss = masked_sum(seq_losses, seq_mask) / num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = float(loss_mat.shape[-1]) if norm_len is None else norm_len
        if norm <= 0:
            raise ValueError(f"norm_len must be > 0 (e.g. the max response length), got {norm_len}.")
        loss = loss / norm
    return loss


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
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
        loss_agg_mode: See :func:`agg_loss`.
        global_num_tokens: See :func:`agg_loss`.
        global_num_seqs: See :func:`agg_loss`.
        norm_len: See :func:`agg_loss`.
        is_weights: (B, T) detached per-token weights multiplying the token losses before aggregation
            (truncated importance sampling against the rollout engine, :func:`truncated_is_weights`).

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


def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
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
        loss_agg_mode: See :func:`agg_loss`; GSPO's paper uses ``seq-mean-token-mean``.
        global_num_tokens: See :func:`agg_loss`.
        global_num_seqs: See :func:`agg_loss`.
        norm_len: See :func:`agg_loss`.
        is_weights: See :func:`compute_policy_loss`.

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


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    norm_len: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (verl / TRL): ``0.5 * max((v - R)^2, (clip(v, V - c, V + c) - R)^2)``.

    Args:
        vpreds: (B, T) values predicted by the critic being trained (carries the gradient).
        returns: (B, T) targets.
        values: (B, T) values of the critic that scored the batch (the clip centre).
        response_mask: (B, T).
        cliprange_value: Clip half-width ``c``.
        loss_agg_mode: See :func:`agg_loss`.
        global_num_tokens: See :func:`agg_loss`.
        global_num_seqs: See :func:`agg_loss`.
        norm_len: See :func:`agg_loss`.

    Returns:
        ``(vf_loss, metrics)`` with ``critic/vf_clipfrac`` (tokens where the clipped term won).
    """
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(
        clipped_vf_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, {"critic/vf_clipfrac": vf_clipfrac.detach()}
