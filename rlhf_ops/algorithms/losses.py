"""Loss aggregation (shared by every policy loss), the clipped value loss and the entropy term (verl numerics).

The policy losses themselves are in :mod:`rlhf_ops.algorithms.policy_losses`.

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
from rlhf_ops.extensions.algorithms import LOSS_AGG_MODES, LossAggMode

Count = int | float | Tensor | None


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
    loss_agg_mode: LossAggMode | str,
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
