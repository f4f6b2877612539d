"""Micro-batches: fixed size, or balanced under a token budget (dynamic batch size), and the inverse permutation.

Notation: B = rows of the batch handed in, T = full sequence length, k = number of micro-batches.

Dynamic batch size (verl's ``rearrange_micro_batches``): a sequence costs its valid tokens
(``attention_mask.sum(-1)``); sequences are grouped into the fewest micro-batches whose token totals fit
``max_token_len``, balanced by Karmarkar-Karp. FSDP runs collectives in every forward / backward, so every
rank of the data-parallel group must run the same number of micro-batches: k is all-reduced (MAX) over
the group and ranks that need fewer micro-batches split theirs further.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_ops.protocol import DataProto
from rlhf_ops.seqlen_balancing import karmarkar_karp, partition_sums
from workers.utils.dist import all_reduce

__all__ = ["make_micro_batches", "rearrange_micro_batches", "restore_order", "split_fixed", "split_mini_batches"]


def split_fixed(data: DataProto, micro_batch_size: int) -> list[DataProto]:
    """Consecutive micro-batches of ``micro_batch_size`` rows (views; the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
    return data.split(micro_batch_size)


def _fits(seqlens: Sequence[int], groups: Sequence[Sequence[int]], budget: int) -> bool:
    return max(partition_sums(seqlens, groups)) <= budget


def _min_feasible_partition(seqlens: Sequence[int], budget: int) -> list[list[int]]:
    """The balanced partition with the fewest groups whose totals all fit ``budget`` (k = n always fits)."""
    k = max(1, math.ceil(sum(seqlens) / budget))
    while True:
        groups = karmarkar_karp(seqlens, k)
        if _fits(seqlens, groups, budget):
            return groups
        k += 1


def _partition_into(seqlens: Sequence[int], k: int, budget: int, feasible: list[list[int]]) -> list[list[int]]:
    """``k`` groups under ``budget``: Karmarkar-Karp with k, else split the heaviest feasible groups."""
    groups = karmarkar_karp(seqlens, k)
    if _fits(seqlens, groups, budget):
        return groups
    groups = [list(g) for g in feasible]
    while len(groups) < k:  # halving a group keeps both halves under the budget
        heavy = max((g for g in groups if len(g) > 1), key=lambda g: sum(seqlens[i] for i in g))
        groups.remove(heavy)
        sub = karmarkar_karp([seqlens[i] for i in heavy], 2)
        groups.extend([heavy[j] for j in part] for part in sub)
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def rearrange_micro_batches(
    data: DataProto, *, max_token_len: int, dp_group: dist.ProcessGroup | None = None
) -> tuple[list[DataProto], list[list[int]]]:
    """Balanced micro-batches under a token budget; the same count on every rank of ``dp_group``.

    A collective over ``dp_group`` when ``torch.distributed`` is initialised (all-reduce MAX of the count).

    Args:
        data: Holds ``attention_mask`` (B, T).
        max_token_len: Token budget of one micro-batch (valid tokens, summed over its sequences).
        dp_group: Data-parallel group (default: the default group).

    Returns:
        ``(micro_batches, indices)``: ``micro_batches[j] = data[indices[j]]`` (gathered copies); pass the
        per-micro-batch outputs and ``indices`` to :func:`restore_order` to get rows in the input order.

    Raises:
        ValueError: A sequence longer than ``max_token_len``, or fewer rows than the group-wide count.
    """
    attention_mask = data.batch["attention_mask"] if data.batch is not None else None
    if attention_mask is None:
        raise ValueError("rearrange_micro_batches needs data.batch['attention_mask'] (B, T).")
    seqlens = attention_mask.sum(dim=-1).tolist()  # (B,) valid tokens per row
    longest = max(seqlens, default=0)
    if longest > max_token_len:
        raise ValueError(
            f"a sequence has {longest} tokens but the micro-batch token budget is {max_token_len}; raise "
            "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu to at least the max prompt + response length."
        )
    feasible = _min_feasible_partition(seqlens, max_token_len)
    count = torch.tensor([len(feasible)], dtype=torch.long, device=attention_mask.device)
    k = int(all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group).item())
    if k > len(seqlens):
        raise ValueError(
            f"another data-parallel rank needs {k} micro-batches but this rank holds only {len(seqlens)} sequences; "
            "raise the token budget (ppo_max_token_len_per_gpu) or balance the batch across ranks before dispatch."
        )
    groups = feasible if k == len(feasible) else _partition_into(seqlens, k, max_token_len, feasible)
    return [data[g] for g in groups], groups


def restore_order(outputs: Sequence[Tensor], indices: Sequence[Sequence[int]]) -> Tensor:
    """Concatenates per-micro-batch outputs and undoes the permutation: row i of the result is input row i.

    Args:
        outputs: ``outputs[j]`` is (len(indices[j]), ...).
        indices: Rows of the input each micro-batch held (from :func:`rearrange_micro_batches`).

    Raises:
        ValueError: Mismatched lengths, or ``indices`` not a permutation of ``range(B)``.
    """
    if len(outputs) != len(indices) or any(len(o) != len(i) for o, i in zip(outputs, indices, strict=False)):
        raise ValueError("restore_order needs one output per micro-batch with one row per index.")
    flat = torch.tensor([i for group in indices for i in group], dtype=torch.long)
    if not torch.equal(torch.sort(flat).values, torch.arange(len(flat))):
        raise ValueError(f"indices must be a permutation of range({len(flat)}).")
    stacked = torch.cat(list(outputs), dim=0)
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(len(flat))  # stacked row inverse[i] came from input row i
    return stacked[inverse.to(stacked.device)]


def make_micro_batches(
    data: DataProto,
    *,
    use_dynamic_bsz: bool,
    micro_batch_size: int,
    max_token_len: int,
    dp_group: dist.ProcessGroup | None = None,
) -> tuple[list[DataProto], list[list[int]]]:
    """Fixed-size (consecutive rows) or token-budget micro-batches, always with their row indices."""
    if use_dynamic_bsz:
        return rearrange_micro_batches(data, max_token_len=max_token_len, dp_group=dp_group)
    micro = split_fixed(data, micro_batch_size)
    starts = range(0, len(data), micro_batch_size)
    return micro, [list(range(s, min(s + micro_batch_size, len(data)))) for s in starts]


def split_mini_batches(
    data: DataProto, *, mini_batch_size: int, shuffle: bool, generator: torch.Generator | None = None
) -> list[DataProto]:
    """This rank's mini-batches of ``mini_batch_size`` rows, optionally shuffled first (seeded ``generator``).

    Raises:
        ValueError: ``len(data)`` not a positive multiple of ``mini_batch_size`` (the batch plan guarantees it
            for batches the driver dispatched; anything else is a caller bug worth stopping on).
    """
    if mini_batch_size < 1 or len(data) == 0 or len(data) % mini_batch_size:
        raise ValueError(
            f"this rank holds {len(data)} sequences, not a positive multiple of the per-rank mini-batch size "
            f"{mini_batch_size}; dispatch train_batch_size * rollout.n / dp sequences per rank (the batch plan)."
        )
    if shuffle:
        data = data.reorder(torch.randperm(len(data), generator=generator))
    return data.split(mini_batch_size)
