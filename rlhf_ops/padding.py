"""Padding helpers that build the dense (B, L) tensors stored in a :class:`~rlhf_ops.protocol.DataProto`.

Notation: B = batch size, P = prompt length (left-padded), R = response length (right-padded),
T = P + R (full sequence), L = any padded length.

Conventions (verl's): prompts are left-padded so every prompt ends at column P - 1 and generation
continues at column P; responses are right-padded; ``position_ids`` count valid tokens only, so a
left-padded prompt starts at position 0 exactly like an unpadded one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "build_full_sequence",
    "compute_position_ids",
    "get_response_mask",
    "last_valid_index",
    "pad_sequences_left",
]


def _pad_sequences(
    seqs: Sequence[Sequence[int] | Sequence[float] | Tensor],
    *,
    pad_value: float,
    max_length: int | None,
    dtype: torch.dtype | None,
    left: bool = True,
) -> Tensor:
    rows = [s.flatten() if isinstance(s, Tensor) else torch.as_tensor(list(s)) for s in seqs]
    if dtype is None:
        dtype = rows[0].dtype if rows and isinstance(seqs[0], Tensor) else torch.long
    longest = max((len(r) for r in rows), default=0)
    length = longest if max_length is None else max_length
    if longest > length:
        raise ValueError(
            f"max_length={max_length} but the longest sequence has {longest} tokens; "
            "truncate the sequences first or raise max_length."
        )
    out = torch.full((len(rows), length), pad_value, dtype=dtype)
    for i, row in enumerate(rows):
        n = len(row)
        if n == 0:
            continue
        if left:
            out[i, length - n :] = row.to(dtype)
        else:
            out[i, :n] = row.to(dtype)
    return out


def pad_sequences_left(
    seqs: Sequence[Sequence[int] | Sequence[float] | Tensor],
    *,
    pad_value: float,
    max_length: int | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Left-pad ragged sequences into one (B, L) tensor (the prompt layout).

    Args:
        seqs: B sequences (lists or 1-D tensors) of possibly different lengths.
        pad_value: value written in the padding columns (e.g. ``pad_token_id``, or 0 for a mask).
        max_length: L; defaults to the longest sequence. A longer sequence raises ``ValueError``.
        dtype: output dtype; defaults to the first tensor's dtype, else ``torch.long``.

    Returns:
        (B, L) tensor on the CPU; row i ends with ``seqs[i]``.

    The matching attention mask is ``pad_sequences_left([[1] * len(s) for s in seqs], pad_value=0)``.
    """
    return _pad_sequences(seqs, pad_value=pad_value, max_length=max_length, dtype=dtype)


def pad_sequences_right(
    seqs: Sequence[Sequence[int] | Sequence[float] | Tensor],
    *,
    pad_value: float,
    max_length: int | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Right-pad ragged sequences into one (B, L) tensor (the response layout; the multi-turn rollout's).

    Args:
        seqs: B sequences (lists or 1-D tensors) of possibly different lengths.
        pad_value: value written in the padding columns.
        max_length: L; defaults to the longest sequence. A longer sequence raises ``ValueError``.
        dtype: output dtype; defaults to the first tensor's dtype, else ``torch.long``.

    Returns:
        (B, L) tensor on the CPU; row i starts with ``seqs[i]``.
    """
    return _pad_sequences(seqs, pad_value=pad_value, max_length=max_length, dtype=dtype, left=False)


def compute_position_ids(attention_mask: Tensor) -> Tensor:
    """Position ids that count valid tokens only (verl's ``compute_position_id_with_mask``).

    Args:
        attention_mask: (B, T) with 1 on real tokens, 0 on padding (any integer or bool dtype).

    Returns:
        (B, T) ``torch.long``: ``clip(cumsum(mask) - 1, min=0)``. Left padding gets 0, the first real
        token 0, then 1, 2, ...; right padding repeats the last real position (it is masked anyway).
    """
    return torch.clamp(torch.cumsum(attention_mask.long(), dim=-1) - 1, min=0)


def get_response_mask(
    response_ids: Tensor, *, eos_token_id: int | Sequence[int], dtype: torch.dtype = torch.int64
) -> Tensor:
    """Mask that is 1 up to and including the first EOS of each response, 0 after (verl semantics).

    Args:
        response_ids: (B, R) right-padded generated token ids.
        eos_token_id: one id or several (HF generation configs may list several EOS ids).
        dtype: output dtype.

    Returns:
        (B, R) mask. A row without any EOS (truncated at R) is all ones, so a pad id that differs
        from every EOS id counts as valid there; engines must pad truncated rows themselves.
    """
    eos_ids = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, eos_ids).long()
    # cumsum - is_eos counts the EOS tokens strictly before each column: 0 up to and including the first EOS.
    return (torch.cumsum(is_eos, dim=1) - is_eos).eq(0).to(dtype)


def build_full_sequence(
    prompts: Tensor, *, prompt_mask: Tensor, responses: Tensor, response_mask: Tensor
) -> dict[str, Tensor]:
    """Concatenate left-padded prompts and right-padded responses into the full (B, T) sequence.

    Args:
        prompts: (B, P) left-padded prompt ids.
        prompt_mask: (B, P) 1 on real prompt tokens.
        responses: (B, R) right-padded response ids.
        response_mask: (B, R) 1 on valid response tokens (see :func:`get_response_mask`).

    Returns:
        ``{"input_ids", "attention_mask", "position_ids"}``, each (B, T = P + R); ``attention_mask``
        takes ``prompt_mask``'s dtype and ``position_ids`` come from :func:`compute_position_ids`.
        Ready for ``DataProto.from_dict(tensors=...)``.
    """
    if prompts.dim() != 2 or prompts.shape != prompt_mask.shape:
        raise ValueError(
            f"prompts {tuple(prompts.shape)} and prompt_mask {tuple(prompt_mask.shape)} must both be (B, P)."
        )
    if responses.dim() != 2 or responses.shape != response_mask.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} must both be (B, R)."
        )
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(
            f"prompts have B={prompts.shape[0]} rows but responses have B={responses.shape[0]}; "
            "repeat the prompts to one row per sample first (DataProto.repeat)."
        )
    input_ids = torch.cat([prompts, responses.to(prompts.dtype)], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": compute_position_ids(attention_mask),
    }


def last_valid_index(mask: Tensor) -> Tensor:
    """(B,) column of each row's last 1 in ``mask`` (B, R); 0 for a row without any.

    Unlike ``mask.sum(-1) - 1`` this is right when the mask has holes: a multi-turn response's mask is 0
    on tool output inside the response, and the score belongs on the model's last token.
    """
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # 1-based so an all-zero row gives 0
    return ((mask != 0).long() * columns).amax(dim=-1).sub(1).clamp(min=0)
