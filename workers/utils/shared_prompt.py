"""Shared-prompt packing: each distinct prompt of a micro-batch is forwarded once, and every response attends to it.

Notation: b = rows of the micro-batch, T = P + R full length, P = prompt columns, R = response columns, u = distinct
prompts, N = packed tokens (the u prompts' valid tokens + the b responses' valid tokens), K = response tokens.

GRPO-style rollouts sample ``rollout.n`` responses per prompt, so a micro-batch of n rows holds one prompt n times.
A padded (or packed) forward computes that prompt's hidden states n times over, although causal attention makes
them identical in every row: the prompt never sees its response. Here the micro-batch becomes one packed row::

    [prompt 0][prompt 1] ... [response 0][response 1] ... [response b-1]

with the batch's own position ids (a response continues its prompt's positions) and a (1, 1, N, N) attention mask:
a prompt token attends causally within its prompt, a response token to its whole prompt and causally within its
own response. Every token then sees exactly what it sees in its own padded row, so log-probs, entropy and
gradients are those of the padded forward (to float rounding; tested), and the prompt's share of the linear
layers' work drops n-fold (a backward through the shared prompt sums the n responses' gradients, as it must).
Attention is dense over the N x N mask: the block structure is not exploited (sdpa or eager on CPU; FlashAttention
cannot take such a mask, so the config refuses ``flash_attention_2``).

The positions predicting a response's first token are its prompt's last token, shared by the n rows of a group:
the LM head's kept positions repeat it once per row (``logits_to_keep`` takes repeated indices; the backward adds
their gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from workers.utils.prompt_group_attention import PER_PROMPT_ATTENTION
from workers.utils.remove_padding import PackedBatch

__all__ = ["forwarded_lengths", "pack_shared_prompts", "shared_prompt_mask_dtype"]


def shared_prompt_mask_dtype(module: nn.Module) -> torch.dtype:
    """The explicit attention mask's dtype for the model's attention: bool for sdpa, additive fp32 for eager."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None) or "sdpa"
    if impl in ("sdpa", PER_PROMPT_ATTENTION):
        return torch.bool
    if impl == "eager":
        return torch.float32
    raise ValueError(
        f"<role>.share_prompt_prefix needs an explicit attention mask, which attn_implementation={impl!r} does not "
        "take; set model.attn_implementation=sdpa (or eager), or <role>.share_prompt_prefix=false"
    )


def _prefix_mask_ok(valid: Tensor) -> bool:
    """Whether every row's valid response columns form a prefix 0 .. L-1 (right padding only)."""
    lengths = valid.sum(-1, keepdim=True)  # (b, 1)
    cols = torch.arange(valid.shape[-1], device=valid.device)
    return bool(torch.equal(valid, cols.unsqueeze(0) < lengths))


def pack_shared_prompts(
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    *,
    response_length: int,
    mask_dtype: torch.dtype = torch.bool,
) -> PackedBatch | None:
    """Packs a micro-batch with each distinct prompt once; None when no two rows share a prompt (or the layout is
    not left-padded prompts + right-padded responses), where the caller's usual forward costs the same.

    Args:
        input_ids: (b, T), prompt columns first, then R response columns.
        attention_mask: (b, T) 1 on valid tokens.
        position_ids: (b, T) positions of the tokens (a response continues its prompt's positions).
        response_length: R.
        mask_dtype: ``torch.bool`` (True = attend; sdpa) or a float dtype (0 / dtype's min, additive; eager).

    Returns:
        A :class:`~workers.utils.remove_padding.PackedBatch` with its ``attention_mask`` (1, 1, N, N) set; its
        ``keep`` / ``labels`` / ``rows`` / ``cols`` hold one entry per valid response token, so
        :func:`~workers.utils.remove_padding.scatter_response` places per-token results into (b, R).
    """
    if position_ids.dim() != 2:  # multi-axis positions (M-RoPE) are not packed here
        return None
    rows, total = input_ids.shape
    prompt_len = total - response_length
    device = input_ids.device
    prompt_valid = attention_mask[:, :prompt_len].bool()  # (b, P)
    resp_valid = attention_mask[:, prompt_len:].bool()  # (b, R)
    if not _prefix_mask_ok(resp_valid) or not bool(prompt_valid[:, -1].all()):
        return None  # a response that does not start right after its prompt's last column
    key = input_ids[:, :prompt_len].masked_fill(~prompt_valid, -1)  # (b, P) padding never matches a token
    uniq, group = torch.unique(key, dim=0, return_inverse=True)  # group: (b,) distinct-prompt index of each row
    distinct = uniq.shape[0]
    if distinct == rows:
        return None
    # The first row of each group stands for its prompt; groups are numbered in the order they first appear.
    order = torch.arange(rows, device=device)
    first = torch.full((distinct,), rows, dtype=torch.long, device=device).scatter_reduce(
        0, group, order, reduce="amin"
    )  # (u,)
    first, by_appearance = torch.sort(first)
    group = torch.argsort(by_appearance)[group]
    p_valid = prompt_valid[first]  # (u, P)
    p_ids = input_ids[first, :prompt_len][p_valid]  # (Np,)
    p_pos = position_ids[first, :prompt_len][p_valid]  # (Np,)
    p_group = torch.arange(distinct, device=device).unsqueeze(1).expand(-1, prompt_len)[p_valid]  # (Np,)
    p_end = torch.cumsum(p_valid.sum(-1), 0) - 1  # (u,) packed index of each prompt's last token
    r_ids = input_ids[:, prompt_len:][resp_valid]  # (K,)
    r_pos = position_ids[:, prompt_len:][resp_valid]  # (K,)
    r_row = order.unsqueeze(1).expand(-1, response_length)[resp_valid]  # (K,)
    r_col = torch.arange(response_length, device=device).unsqueeze(0).expand(rows, -1)[resp_valid]  # (K,)
    n_prompt = p_ids.shape[0]
    packed_index = n_prompt + torch.arange(r_ids.shape[0], device=device)  # (K,)
    # Response token c of a row is predicted by token c - 1 of the same row, the first one by its prompt's last.
    keep = torch.where(r_col == 0, p_end[group[r_row]], packed_index - 1)  # (K,)

    # Per packed token: its prompt group, and its row (-1 for prompt tokens).
    tok_group = torch.cat([p_group, group[r_row]])  # (N,)
    tok_row = torch.cat([torch.full_like(p_group, -1), r_row])  # (N,)
    is_prompt = tok_row < 0
    same_group = tok_group.unsqueeze(1) == tok_group.unsqueeze(0)  # (N, N) [query, key]
    same_row = (tok_row.unsqueeze(1) == tok_row.unsqueeze(0)) & ~is_prompt.unsqueeze(0)
    causal = torch.ones(same_group.shape, dtype=torch.bool, device=device).tril()
    allowed = causal & ((same_group & is_prompt.unsqueeze(0)) | same_row)  # keys: own prompt, own response so far
    if mask_dtype == torch.bool:
        mask = allowed
    else:
        mask = torch.zeros(allowed.shape, dtype=mask_dtype, device=device).masked_fill(
            ~allowed, torch.finfo(mask_dtype).min
        )
    return PackedBatch(
        input_ids=torch.cat([p_ids, r_ids]).unsqueeze(0),
        position_ids=torch.cat([p_pos, r_pos]).unsqueeze(0),
        keep=keep,
        labels=r_ids,
        rows=r_row,
        cols=r_col,
        attention_mask=mask.unsqueeze(0).unsqueeze(0),
    )


def forwarded_lengths(input_ids: Tensor, attention_mask: Tensor, *, response_length: int) -> list[int]:
    """The token lengths a shared-prompt forward of these rows runs on (for the FLOP count behind MFU): each distinct
    prompt's valid tokens once, then each row's valid response tokens."""
    prompt_len = input_ids.shape[-1] - response_length
    prompt_valid = attention_mask[:, :prompt_len].bool()
    key = input_ids[:, :prompt_len].masked_fill(~prompt_valid, -1)
    uniq = torch.unique(key, dim=0)
    prompts = (uniq >= 0).sum(-1).tolist()
    return [*prompts, *attention_mask[:, prompt_len:].sum(-1).tolist()]
