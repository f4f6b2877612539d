"""Ulysses sequence parallelism (DeepSpeed-Ulysses, verl's ``ulysses.py``) for HF models under FSDP2.

Notation: sp = ranks of one SP group, N = packed tokens of a micro-batch, N_pad = N rounded up to a multiple
of sp, n = N_pad / sp tokens per rank, h / h_kv = query / key-value heads, d = head dim, b = rows (1 when packed).

One forward on the packed (remove-padding) path, every rank of the group holding the same micro-batch:

1. :func:`shard_packed`: the packed row (1, N) is padded to N_pad (token 0, positions 0, 1, ...: a sequence of
   its own that no real token attends to) and rank r keeps columns ``[r n, (r + 1) n)``.
2. The model runs on (1, n): embeddings, RoPE (from the local position ids), norms and MLPs are per token.
3. Attention (:func:`ulysses_attention_forward`, registered in transformers' ``AttentionInterface``):
   q, k, v (b, h, n, d) -> all-to-all -> (b, h / sp, N_pad, d), i.e. the whole sequence for 1/sp of the
   heads; the model's own kernel (eager / sdpa / flash-attention) runs with the per-sequence causal mask of
   the gathered position ids; its output (b, N_pad, h / sp, d) -> all-to-all -> (b, n, h, d).
4. Per-token results (log-probs, values) are computed locally and gathered to (N_pad,) by :meth:`SPShard.gather`.

The attention is a no-op wrapper of the base kernel outside :func:`ulysses_sequence_parallel` (generation,
evaluation), so one module serves both the sharded training forward and full-sequence decoding.

Gradients: the all-to-all's backward is the inverse all-to-all; the gather's backward keeps this rank's
slice of the incoming gradient, which is exact because every rank of the group computes the SAME loss from
the gathered tensor. Each rank's parameter gradient is then the share of the computations it ran, and the sum
over the SP group is the full gradient. FSDP averages over all dp x sp ranks, so the caller multiplies the
loss by dp x sp (verl scales by sp in the gather's backward and by dp in the loss: the same product).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ATTENTION_PREFIX",
    "SPShard",
    "all_to_all",
    "enable_ulysses_attention",
    "gather_seq",
    "packed_causal_mask",
    "shard_packed",
    "sp_rank",
    "sp_world_size",
    "ulysses_attention_forward",
    "ulysses_sequence_parallel",
]

ATTENTION_PREFIX = "ulysses_"
"""Registered attention names are ``ulysses_<base>``, e.g. ``ulysses_sdpa``."""
_BASES = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
_ACTIVE: dict[str, dist.ProcessGroup | None] = {"group": None}  # process-wide: autograd may run on other threads


def sp_world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks of ``group``; 1 for None (no sequence parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def sp_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------------------- collectives
def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # (sp, ...): chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i] is rank i's chunk meant for this rank
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # The inverse exchange routes every gradient chunk back to the rank that produced its input.
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: Tensor, *, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Splits ``x`` into sp chunks along ``scatter_dim`` (chunk j to rank j) and concatenates the received
    chunks along ``gather_dim`` in rank order (differentiable).

    Example: (b, h, n, d) with ``scatter_dim=1, gather_dim=2`` becomes (b, h / sp, N_pad, d).

    Raises:
        ValueError: ``x.shape[scatter_dim]`` is not a multiple of the group size.
    """
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} does not split over {size} ranks.")
    out: Tensor = _AllToAll.apply(x, group, scatter_dim, gather_dim)
    return out


def _all_gather_cat(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # Every rank computes the same function of the gathered tensor, so the gradient of this rank's part is
        # simply its slice (summing over ranks, as a reduce-scatter would, counts it sp times).
        local = grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[dist.get_rank(ctx.group)]
        return local.contiguous(), None, None


def gather_seq(x: Tensor, *, group: dist.ProcessGroup | None, dim: int = -1) -> Tensor:
    """Concatenates every rank's equally shaped ``x`` along ``dim`` in rank order (differentiable; see the
    module docstring for why the backward keeps this rank's slice). Identity for a group of one or None."""
    if sp_world_size(group) == 1:
        return x
    assert group is not None
    if not x.is_floating_point():
        return _all_gather_cat(x, group, dim)  # integer tensors (positions) carry no gradient
    out: Tensor = _GatherSeq.apply(x, group, dim)
    return out


# ----------------------------------------------------------------------------------------- slicing
@dataclass(frozen=True, kw_only=True)
class SPShard:
    """This rank's slice of a packed row, padded to a multiple of sp."""

    input_ids: Tensor
    """(1, n) local tokens."""
    position_ids: Tensor
    """(1, n) their positions (restarting at 0 per sequence; the padding restarts too)."""
    start: int
    """Packed index of the first local token."""
    pad: int
    """N_pad - N."""
    group: dist.ProcessGroup | None

    @property
    def length(self) -> int:
        """n, tokens on this rank."""
        return int(self.input_ids.shape[-1])

    def select(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Which of the packed indices ``index`` (K,) are local: ``(bool mask (K,), local columns (k_r,))``."""
        local = (index >= self.start) & (index < self.start + self.length)
        return local, index[local] - self.start

    def gather(self, values: Tensor, local_index: Tensor | None = None) -> Tensor:
        """Per-token values of every rank as one (N_pad,) row (differentiable).

        Args:
            values: (n,) one per local token, or (k_r,) at ``local_index`` (other local tokens get 0).
            local_index: (k_r,) local columns of ``values``; None when ``values`` covers every local token.
        """
        if local_index is not None:
            values = values.new_zeros(self.length).index_put((local_index,), values)  # (n,)
        return gather_seq(values, group=self.group, dim=-1)


def shard_packed(input_ids: Tensor, position_ids: Tensor, *, group: dist.ProcessGroup | None) -> SPShard:
    """Pads a packed row (1, N) to a multiple of sp and keeps this rank's contiguous slice.

    The padding is token 0 at positions 0, 1, ...: a separate sequence under the packed causal mask, so it
    changes no real token's result (verl's ``ulysses_pad``).
    """
    size, rank = sp_world_size(group), sp_rank(group)
    total = int(input_ids.shape[-1])
    pad = (-total) % size
    if pad:
        input_ids = F.pad(input_ids, (0, pad), value=0)
        extra = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype).unsqueeze(0)  # (1, pad)
        position_ids = torch.cat([position_ids, extra], dim=-1)
    n = (total + pad) // size
    start = rank * n
    return SPShard(
        input_ids=input_ids[:, start : start + n],
        position_ids=position_ids[:, start : start + n],
        start=start,
        pad=pad,
        group=group,
    )


def packed_causal_mask(position_ids: Tensor) -> Tensor:
    """Boolean mask (b, 1, N, N), True where query i may attend key j: same packed sequence and j <= i.

    A new sequence starts wherever the position does not grow by one (transformers' rule in
    ``find_packed_sequence_indices``), so position ids restarting at 0 separate the sequences.
    """
    first = position_ids[:, :1] - 1
    seq = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # (b, N) sequence index per token
    idx = torch.arange(position_ids.shape[-1], device=position_ids.device)
    causal = idx[:, None] >= idx[None, :]  # (N, N)
    same = seq[:, :, None] == seq[:, None, :]  # (b, N, N)
    return (same & causal).unsqueeze(1)


# ----------------------------------------------------------------------------------------- attention
@contextmanager
def ulysses_sequence_parallel(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Turns the Ulysses attention on for ``group`` inside the block (nested blocks restore the outer group).

    Everything the model runs inside must be sharded with :func:`shard_packed`, on every rank of the group.
    Keep the block open across ``backward`` when activation checkpointing recomputes attention there. The
    state is process-wide (not a context variable): CUDA autograd runs backward on its own threads.
    """
    previous = _ACTIVE["group"]
    _ACTIVE["group"] = group if sp_world_size(group) > 1 else None
    try:
        yield
    finally:
        _ACTIVE["group"] = previous


class _OneQueryHeadPerKV:
    """The attention module as the base kernel must see it once k / v are repeated to one head per query head."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _base_attention(base: str, module: nn.Module) -> Callable[..., tuple[Tensor, Tensor | None]]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base != "eager":
        fn: Callable[..., tuple[Tensor, Tensor | None]] = ALL_ATTENTION_FUNCTIONS[base]
        return fn
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"model.attn_implementation='eager': {type(module).__module__} has no eager_attention_forward for "
            "Ulysses to wrap; set model.attn_implementation=sdpa."
        )
    return eager


def ulysses_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    base: str,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """HF attention function: the ``base`` kernel, with heads <-> sequence all-to-alls inside an SP block.

    Args:
        module: The attention layer (reads ``num_key_value_groups``, ``is_causal``, ``training``).
        query: (b, h, n, d) after RoPE on the local positions.
        key: (b, h_kv, n, d).
        value: (b, h_kv, n, d).
        attention_mask: The model's mask; used only outside an SP block (inside, the model builds none and
            the mask of the whole packed row is built here from the gathered ``position_ids``).
        base: ``eager``, ``sdpa``, ``flash_attention_2`` or ``flash_attention_3``.
        **kwargs: The model's attention kwargs; ``position_ids`` (b, n) is required inside an SP block.

    Returns:
        ``(output (b, n, h, d), None)``; outside an SP block, whatever the base kernel returns.

    Raises:
        ValueError: h not divisible by sp, or no ``position_ids``.
    """
    base_fn = _base_attention(base, module)
    group = _ACTIVE["group"]
    if group is None:
        return base_fn(module, query, key, value, attention_mask, **kwargs)
    size = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % size:
        raise ValueError(f"{heads} attention heads do not split over ulysses_sequence_parallel_size={size}.")
    target: Any = module
    if kv_heads % size:  # GQA with fewer kv heads than ranks: one kv head per query head, then split
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        target = _OneQueryHeadPerKV(module)
    local_positions = kwargs.pop("position_ids", None)
    if local_positions is None:
        raise ValueError("Ulysses attention needs the model to pass position_ids (a packed, sharded forward).")
    positions = gather_seq(local_positions, group=group, dim=-1)  # (b, N_pad)
    q, k, v = (all_to_all(t, group=group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    mask: Tensor | None = None
    if base.startswith("flash"):
        kwargs["position_ids"] = positions  # flash-attention derives cu_seqlens of the packed row from them
    else:
        mask = packed_causal_mask(positions)  # (b, 1, N_pad, N_pad)
        if base == "eager":  # additive float mask, as transformers' eager_mask
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
    out, _ = base_fn(target, q, k, v, mask, **kwargs)  # (b, N_pad, h / sp, d)
    return all_to_all(out, group=group, scatter_dim=1, gather_dim=2), None  # (b, n, h, d)


def _ulysses_mask(*, base: str, **kwargs: Any) -> Any:
    """Mask builder of ``ulysses_<base>``: the base one outside an SP block; inside, none (built per layer)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if _ACTIVE["group"] is not None:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[base](**kwargs)


def check_ulysses_heads(config: Any, sp_size: int, *, key: str = "actor.ulysses_sequence_parallel_size") -> None:
    """Refuses an SP size that does not divide the model's query heads, before any forward.

    Ulysses hands each SP rank ``h / sp`` whole heads; SmolLM2-135M's 9 heads split over 3 or 9 ranks, not 2.
    (Fewer kv heads than ranks is fine: they are repeated per query head before the all-to-all.)

    Raises:
        ValueError: naming ``key`` and the divisors that work.
    """
    heads = getattr(config, "num_attention_heads", None)
    if sp_size > 1 and isinstance(heads, int) and heads % sp_size:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"{key}={sp_size} does not divide the model's {heads} attention heads (Ulysses gives each rank whole "
            f"heads); set it to one of {divisors}."
        )


def enable_ulysses_attention(model: nn.Module) -> str:
    """Switches an HF model to ``ulysses_<base>`` attention, registering it with transformers (idempotent).

    Outside :func:`ulysses_sequence_parallel` the model computes exactly as before (same kernel, same mask).

    Returns:
        The new attention implementation name.

    Raises:
        ValueError: The model's attention is not one of eager / sdpa / flash_attention_2 / flash_attention_3.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    config: Any = model.config
    current = str(config._attn_implementation)
    if current.startswith(ATTENTION_PREFIX):
        return current
    if current not in _BASES:
        raise ValueError(
            f"model.attn_implementation={current!r} does not support Ulysses sequence parallelism; set one of "
            f"{list(_BASES)} or actor.ulysses_sequence_parallel_size=1."
        )
    name = ATTENTION_PREFIX + current
    AttentionInterface.register(name, functools.partial(ulysses_attention_forward, base=current))
    AttentionMaskInterface.register(name, functools.partial(_ulysses_mask, base=current))
    config._attn_implementation = name
    return name
