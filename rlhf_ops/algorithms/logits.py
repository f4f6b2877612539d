"""Token log-probs and entropy from logits, in fp32 and chunked over rows to bound peak memory.

Shape notation: N...: any leading dims (e.g. B, T or a packed total-token dim), V: vocab size.
Results are fp32 whatever the logits dtype (a bf16 log-softmax keeps ~3 significant digits, too few for
the PPO ratio). Only one chunk of rows is upcast at a time, so an fp32 copy of the whole (N, V) logits is
never materialised in the forward pass. Rows are shifted by their max first, so the final subtraction
does not cancel digits away when logits are large.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_chunk(chunk_size: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 (rows of logits upcast at once), got {chunk_size}.")


def _shifted(rows: Tensor) -> Tensor:
    """fp32 rows minus their max (a constant per row, so no gradient flows through it).

    Both results are invariant to the shift, and with logits near 0 the final subtraction keeps full fp32
    precision: with logits ~1e3, ``z - logsumexp(z)`` would lose 5 digits to cancellation.
    """
    rows = rows.float()
    return rows - rows.max(dim=-1, keepdim=True).values.detach()


def logprobs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``: ``z[label] - logsumexp(z)``.

    Args:
        logits: (N..., V), any float dtype.
        labels: (N...) token ids, integer dtype.
        chunk_size: Rows (flattened leading positions) processed per step.

    Returns:
        (N...) fp32 log-probs; differentiable w.r.t. ``logits``.
    """
    _check_chunk(chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal the logits shape without the vocab dim, "
            f"{tuple(logits.shape[:-1])}."
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_labels = labels.reshape(-1, 1)  # (N, 1)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = _shifted(flat_logits[start : start + chunk_size])
        picked = rows.gather(-1, flat_labels[start : start + chunk_size]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(rows, dim=-1))
    if not pieces:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(labels.shape)


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of ``softmax(logits)`` in the stable form ``logsumexp(z) - sum(softmax(z) * z)``.

    Args:
        logits: (N..., V), any float dtype.
        chunk_size: Rows (flattened leading positions) processed per step.

    Returns:
        (N...) fp32 entropy in nats; differentiable w.r.t. ``logits``.
    """
    _check_chunk(chunk_size)
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        rows = _shifted(flat_logits[start : start + chunk_size])
        probs = torch.softmax(rows, dim=-1)
        # where(): a -inf logit (masked vocab entry) has p = 0 and must add 0, not 0 * -inf = NaN.
        p_times_z = torch.where(probs > 0, probs * rows, torch.zeros_like(rows))
        pieces.append(torch.logsumexp(rows, dim=-1) - p_times_z.sum(dim=-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(logits.shape[:-1])
