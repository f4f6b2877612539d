"""Remove padding: pack the valid tokens of a micro-batch into one row and scatter results back.

Notation: B = rows, T = full length (P + R), R = response length, N = valid tokens of the micro-batch,
K = packed positions that predict a response column.

The packed row is ``(1, N)`` with per-sequence ``position_ids`` (restarting at 0 for every sequence, as the
batch's own ``position_ids`` already do for valid tokens) and no attention mask: transformers (>= 4.5x)
detects packed sequences from the position resets and builds a block-diagonal causal mask for
eager / sdpa (flash-attention-2 uses ``cu_seqlens`` derived the same way). This requires each sequence's
valid tokens to be contiguous with positions ``0, 1, 2, ...`` (left-padded prompt + right-padded response).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["PackedBatch", "pack_sequences", "scatter_response"]


@dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """One micro-batch with its padding removed."""

    input_ids: Tensor
    """(1, N) valid tokens of every row, row after row."""
    position_ids: Tensor
    """(1, N) positions of those tokens (restart at 0 at each sequence)."""
    keep: Tensor
    """(K,) packed indices whose logits predict a response token (columns T - R - 1 .. T - 2)."""
    labels: Tensor
    """(K,) the token each kept position predicts (the next packed token)."""
    rows: Tensor
    """(K,) batch row of each kept position."""
    cols: Tensor
    """(K,) response column (0 .. R - 1) of the token each kept position predicts."""
    attention_mask: Tensor | None = None
    """(1, 1, N, N) explicit mask (``workers.utils.shared_prompt``); None: block-diagonal from the positions."""


def pack_sequences(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *, response_length: int
) -> PackedBatch:
    """Packs the valid tokens of ``input_ids`` (B, T) into one row and locates the response predictions.

    Args:
        input_ids: (B, T).
        attention_mask: (B, T) 1 on valid tokens.
        position_ids: (B, T) positions (0-based over valid tokens).
        response_length: R; responses are the last R columns.

    Returns:
        The :class:`PackedBatch`. A kept position whose next column is padding gets the first token of the
        next sequence as label: such positions are outside ``response_mask`` and must be masked by the caller.
    """
    batch, seq_len = input_ids.shape
    flat_mask = attention_mask.reshape(-1).bool()  # (B*T,)
    flat_index = torch.nonzero(flat_mask, as_tuple=False).squeeze(-1)  # (N,) into B*T, row-major
    packed_ids = input_ids.reshape(-1)[flat_index]  # (N,)
    packed_pos = position_ids.reshape(-1)[flat_index]  # (N,)
    row, col = flat_index // seq_len, flat_index % seq_len
    first = seq_len - response_length - 1  # column predicting the first response token
    keep = torch.nonzero((col >= first) & (col < seq_len - 1), as_tuple=False).squeeze(-1)  # (K,)
    next_tokens = torch.roll(packed_ids, shifts=-1)  # (N,) token at packed index i + 1
    return PackedBatch(
        input_ids=packed_ids.unsqueeze(0),
        position_ids=packed_pos.unsqueeze(0),
        keep=keep,
        labels=next_tokens[keep],
        rows=row[keep],
        cols=col[keep] - first,
    )


def scatter_response(values: Tensor, packed: PackedBatch, *, batch_size: int, response_length: int) -> Tensor:
    """Places per-kept-position values (K,) into a (B, R) tensor of zeros (differentiable)."""
    out = values.new_zeros(batch_size, response_length)
    return out.index_put((packed.rows, packed.cols), values)
