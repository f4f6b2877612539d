"""Karmarkar-Karp partitions and the driver-side balance across data-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from workers.utils import balance_batch_across_dp, karmarkar_karp, partition_sums


def test_equal_size_partition_of_one_to_eight_is_perfect() -> None:
    # 1..8 sums to 36: two groups of 4 with 18 each ([1,4,6,7] and [2,3,5,8], ids shifted by one).
    groups = karmarkar_karp([1, 2, 3, 4, 5, 6, 7, 8], 2, equal_size=True)
    assert groups == [[0, 3, 5, 6], [1, 2, 4, 7]]
    assert partition_sums([1, 2, 3, 4, 5, 6, 7, 8], groups) == [18, 18]


def test_unequal_partition_isolates_a_long_sequence() -> None:
    # 10 | 1 + 1 + 1: the best 2-way split of [10, 1, 1, 1].
    assert karmarkar_karp([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]


def test_every_group_is_non_empty_and_every_index_used_once() -> None:
    lens = [9, 1, 1, 30, 2, 2, 7]
    groups = karmarkar_karp(lens, 5)
    assert len(groups) == 5 and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(7))


def test_karmarkar_karp_rejects_impossible_requests() -> None:
    with pytest.raises(ValueError, match="non-empty groups"):
        karmarkar_karp([1, 2], 3)
    with pytest.raises(ValueError, match="equal_size"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def test_balance_batch_across_dp_bounds_the_token_spread() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (32,), generator=g)
    mask = (torch.arange(40).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (32, 40)
    perm = balance_batch_across_dp(mask, 4)
    assert sorted(perm.tolist()) == list(range(32))
    per_rank = lengths[perm].reshape(4, 8).sum(dim=1)  # chunk(4) of the reordered batch: 8 rows per rank
    assert int(per_rank.max() - per_rank.min()) <= int(lengths.max())
    naive = lengths.reshape(4, 8).sum(dim=1)
    assert per_rank.max() - per_rank.min() <= naive.max() - naive.min()


def test_balance_batch_across_dp_needs_divisible_batches() -> None:
    with pytest.raises(ValueError, match="pad_to_divisor"):
        balance_batch_across_dp(torch.ones(5, 3), 2)
