"""Attention per prompt group: the shared-prompt packed row attended group by group instead of densely.

Notation as in :mod:`workers.utils.shared_prompt`: N packed tokens, u prompt groups, n_g tokens in group g (its
prompt once and its responses).

The shared-prompt row holds u prompts and their responses; its (N, N) mask lets a token see its own prompt and its
own response only, so once the tokens are ordered by group the mask is block-diagonal. sdpa with the dense mask
still computes, and differentiates, all N^2 scores, the zeros of the other groups included: at u = 8 groups that
is 8x the attention work, and the reason larger micro-batches lost on CPU. Here each group's query, key and value
rows are gathered, sdpa runs on them with the group's own (n_g, n_g) mask, and the outputs go back in place:
sum n_g^2 scores instead of N^2, the same values (to float rounding: the softmax runs over fewer masked columns).

The groups are read from the mask itself (a token's group is the first column it sees, its prompt's first token),
once per micro-batch: every layer, and a recomputed forward under activation checkpointing, receives the same mask
tensor. A mask that is not block-diagonal under that grouping (any other explicit mask) goes to sdpa unchanged, as
do padded batches and batches of several rows, so switching a model to this attention never changes what it
computes. Selected by ``actor.share_prompt_attention=per_prompt`` (the actor and the reference policy) and
``critic.share_prompt_attention=per_prompt``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["PER_PROMPT_ATTENTION", "enable_per_prompt_attention", "prompt_groups"]

PER_PROMPT_ATTENTION = "sdpa_per_prompt"
"""The attention implementation's name as registered with transformers."""

_Groups = tuple[list[tuple[Tensor, Tensor]], Tensor]
_CACHE: list[Any] = []  # [weakref to the mask, groups or None]: one micro-batch's mask serves every layer
CALLS = {"per_prompt": 0, "dense": 0}
"""Attention calls that went per group / to sdpa unchanged (read by the tests and the bench)."""


def prompt_groups(mask: Tensor) -> _Groups | None:
    """The prompt groups of a (1, 1, N, N) boolean mask: ``([(token indices, (1, 1, n_g, n_g) mask) ...],
    inverse)`` where concatenating the groups' outputs and indexing with ``inverse`` restores token order; None when
    the mask is not block-diagonal over its groups or holds a single group (dense attention costs the same)."""
    if _CACHE and _CACHE[0]() is mask:
        return _CACHE[1]
    groups = _find_groups(mask)
    _CACHE[:] = [weakref.ref(mask), groups]  # not the mask itself: it is freed with its micro-batch
    return groups


def _find_groups(mask: Tensor) -> _Groups | None:
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1):
        return None
    visible = mask[0, 0]
    first = visible.to(torch.uint8).argmax(-1)  # (N,) the first column each token sees
    order = torch.argsort(first, stable=True)
    starts = first[order]
    cuts = (starts[1:] != starts[:-1]).nonzero().flatten() + 1
    bounds = [0, *cuts.tolist(), len(order)]
    if len(bounds) <= 2:
        return None
    groups: list[tuple[Tensor, Tensor]] = []
    inside = 0
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        idx = order[lo:hi]
        sub = visible.index_select(0, idx).index_select(1, idx)
        inside += int(sub.sum())
        groups.append((idx, sub[None, None]))
    if inside != int(visible.sum()):  # a token sees another group's token: not this packing
        return None
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return groups, inverse


def per_prompt_sdpa(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, None]:
    """transformers' sdpa attention, run per prompt group when the mask is a shared-prompt row's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    found = None
    if attention_mask is not None and query.shape[0] == 1:
        found = prompt_groups(attention_mask)
    if found is None:
        CALLS["dense"] += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    CALLS["per_prompt"] += 1
    groups, inverse = found
    outs = [
        sdpa_attention_forward(
            module, query.index_select(2, idx), key.index_select(2, idx), value.index_select(2, idx), sub, **kwargs
        )[0]
        for idx, sub in groups
    ]  # each (1, n_g, heads, head_dim)
    return torch.cat(outs, dim=1).index_select(1, inverse), None


def enable_per_prompt_attention(model: nn.Module, *, role: str = "actor") -> str:
    """Switches an HF model from sdpa to :data:`PER_PROMPT_ATTENTION`, registering it with transformers
    (idempotent). Padded batches build sdpa's own mask and run sdpa as before.

    Raises:
        ValueError: The model's attention is not sdpa.
    """
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    config: Any = model.config
    current = str(config._attn_implementation)
    if current == PER_PROMPT_ATTENTION:
        return current
    if current != "sdpa":
        raise ValueError(
            f"{role}.share_prompt_attention=per_prompt runs sdpa per prompt group, and the model's attention is "
            f"{current!r}; set model.attn_implementation=sdpa, or {role}.share_prompt_attention=dense"
        )
    AttentionInterface.register(PER_PROMPT_ATTENTION, per_prompt_sdpa)
    AttentionMaskInterface.register(PER_PROMPT_ATTENTION, sdpa_mask)
    config._attn_implementation = PER_PROMPT_ATTENTION
    return PER_PROMPT_ATTENTION
