"""Balanced partitions of sequences by token count (Karmarkar-Karp largest differencing), verl-compatible.

Used twice: across data-parallel ranks before dispatch (:func:`balance_batch_across_dp`, equal sequence
counts per rank, on the driver) and into micro-batches under a token budget (``workers.utils.micro_batch``).
It lives in the library beside ``padding.py`` because the driver (``rlhf_ops.trainer``) uses it; workers import it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["balance_batch_across_dp", "karmarkar_karp", "partition_sums"]

# A state of the largest differencing method: k partial partitions (sum, items), sorted by sum, descending.
_Sets = list[tuple[int, list[int]]]


def _spread(sets: _Sets) -> int:
    return sets[0][0] - sets[-1][0]


def _merge(a: _Sets, b: _Sets) -> _Sets:
    # Largest of one state with the smallest of the other: the difference of the two spreads remains.
    k = len(a)
    merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
    return sorted(merged, key=lambda s: s[0], reverse=True)


def karmarkar_karp(seqlens: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Partitions ``range(len(seqlens))`` into ``k`` groups with near-equal sums of ``seqlens``.

    Largest differencing method for k-way partitioning (as verl's ``seqlen_balancing.karmarkar_karp``): start
    from one state per item (or, with ``equal_size``, one per run of k consecutive sorted items, one item per
    group), repeatedly merge the two states of largest spread. Every group is non-empty when
    ``len(seqlens) >= k``.

    Args:
        seqlens: Token count of each sequence.
        k: Number of groups.
        equal_size: Every group gets ``len(seqlens) / k`` items (needs divisibility).

    Returns:
        ``k`` lists of indices, each sorted ascending, ordered by their smallest index.

    Raises:
        ValueError: ``k`` < 1, more groups than items, or ``equal_size`` without divisibility.
    """
    n = len(seqlens)
    if k < 1 or n < k:
        raise ValueError(f"cannot split {n} sequences into {k} non-empty groups; need 1 <= k <= {n}.")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs the {n} sequences to divide into {k} groups; pad the batch first.")
    order = sorted(range(n), key=lambda i: (seqlens[i], i))
    tie = itertools.count()  # deterministic tie-break between equal spreads
    heap: list[tuple[int, int, _Sets]] = []
    if equal_size:
        starts: list[_Sets] = [[(seqlens[i], [i]) for i in order[o : o + k]] for o in range(0, n, k)]
    else:
        starts = [[(seqlens[i], [i])] + [(0, []) for _ in range(k - 1)] for i in order]
    for sets in starts:
        sets = sorted(sets, key=lambda s: s[0], reverse=True)
        heapq.heappush(heap, (-_spread(sets), next(tie), sets))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b)
        heapq.heappush(heap, (-_spread(merged), next(tie), merged))
    groups = [sorted(items) for _, items in heap[0][2]]
    _fill_empty(groups, seqlens)
    return sorted(groups, key=lambda g: g[0])


def _fill_empty(groups: list[list[int]], seqlens: Sequence[int]) -> None:
    """Moves the shortest item of the most populated group into each empty group (rare: tiny inputs)."""
    for group in groups:
        if not group:
            donor = max(groups, key=len)
            item = min(donor, key=lambda i: seqlens[i])
            donor.remove(item)
            group.append(item)


def partition_sums(seqlens: Sequence[int], groups: Sequence[Sequence[int]]) -> list[int]:
    """Token total of each group."""
    return [sum(seqlens[i] for i in g) for g in groups]


def balance_batch_across_dp(attention_mask: Tensor, dp_size: int) -> Tensor:
    """A permutation of the rows that balances tokens over ``dp_size`` equal chunks (driver-side).

    ``data.reorder(perm).chunk(dp_size)`` then gives rank r the r-th group: every rank gets ``B / dp_size``
    sequences and the token totals differ by about one sequence length at most (verl's
    ``_balance_batch``). Rows within a rank keep their relative order, so GRPO groups stay contiguous
    where they were.

    Args:
        attention_mask: (B, T) 1 on valid tokens.
        dp_size: Data-parallel ranks.

    Returns:
        (B,) int64 permutation.

    Raises:
        ValueError: B not divisible by ``dp_size`` (pad with ``DataProto.pad_to_divisor`` first).
    """
    seqlens = attention_mask.sum(dim=-1).tolist()  # (B,)
    if dp_size < 1 or len(seqlens) % dp_size:
        raise ValueError(
            f"balance_batch_across_dp needs the batch ({len(seqlens)} rows) to divide into dp_size={dp_size} "
            "chunks; pad it with DataProto.pad_to_divisor(dp_size) first."
        )
    groups = karmarkar_karp(seqlens, dp_size, equal_size=True)
    return torch.tensor([i for g in groups for i in g], dtype=torch.long)


def balance_groups_across_dp(attention_mask: Tensor, group_ids: Sequence[object], dp_size: int) -> Tensor | None:
    """Like :func:`balance_batch_across_dp`, but moving whole groups (the samples of one prompt): every rank gets
    the same number of equal-size groups, their rows contiguous and in order, so a micro-batch of n rows holds one
    prompt's n samples (``actor.share_prompt_prefix`` forwards that prompt once). None when the groups cannot be
    dealt out evenly (unequal sizes, or a count ``dp_size`` does not divide): balance rows instead.

    Args:
        attention_mask: (B, T) 1 on valid tokens.
        group_ids: (B,) the group of each row (GRPO's ``uid``); a group's rows need not be adjacent.
        dp_size: Data-parallel ranks.
    """
    members: dict[object, list[int]] = {}
    for row, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(row)
    groups = list(members.values())
    if dp_size < 1 or len(groups) % dp_size or len({len(g) for g in groups}) != 1:
        return None
    seqlens = attention_mask.sum(dim=-1).tolist()  # (B,)
    totals = [sum(seqlens[i] for i in g) for g in groups]
    parts = karmarkar_karp(totals, dp_size, equal_size=True)
    return torch.tensor([row for part in parts for g in part for row in groups[g]], dtype=torch.long)
