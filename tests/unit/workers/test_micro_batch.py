"""Fixed and token-budget micro-batches, the inverse permutation, mini-batch splitting."""

from __future__ import annotations

import pytest
import torch

from rlhf_ops.protocol import DataProto
from tests.unit.workers.fsdp_test_batch import make_ppo_batch
from workers.utils import (
    make_micro_batches,
    rearrange_micro_batches,
    restore_order,
    split_fixed,
    split_mini_batches,
)


def _batch_with_lengths(lengths: list[int], width: int = 10) -> DataProto:
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(len(lengths))})


def test_split_fixed_keeps_order_and_a_short_tail() -> None:
    parts = split_fixed(_batch_with_lengths([1] * 7), 3)
    assert [p.batch["row"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_rearrange_fits_the_budget_with_the_fewest_micro_batches(gloo_world1: None) -> None:
    lengths = [6, 6, 6, 3, 2]  # 23 tokens, budget 10: ceil(23 / 10) = 3 micro-batches suffice (9, 8, 6)
    micro, indices = rearrange_micro_batches(_batch_with_lengths(lengths), max_token_len=10)
    assert len(micro) == 3
    assert all(int(m.batch["attention_mask"].sum()) <= 10 for m in micro)
    assert [m.batch["row"].tolist() for m in micro] == indices
    assert sorted(i for g in indices for i in g) == list(range(5))


def test_rearrange_rejects_a_sequence_over_budget(gloo_world1: None) -> None:
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        rearrange_micro_batches(_batch_with_lengths([3, 11], width=12), max_token_len=10)


def test_restore_order_undoes_the_permutation_exactly(gloo_world1: None) -> None:
    data = make_ppo_batch(batch_size=16, seed=3)
    micro, indices = rearrange_micro_batches(data, max_token_len=20)
    assert len(micro) > 1 and [i for g in indices for i in g] != list(range(16))  # really permuted
    outputs = [m.batch["old_log_probs"] * 1.0 for m in micro]
    assert torch.equal(restore_order(outputs, indices), data.batch["old_log_probs"])


def test_restore_order_rejects_non_permutations() -> None:
    with pytest.raises(ValueError, match="permutation"):
        restore_order([torch.zeros(2), torch.zeros(1)], [[0, 1], [1]])
    with pytest.raises(ValueError, match="one output per micro-batch"):
        restore_order([torch.zeros(2)], [[0, 1], [2]])


def test_make_micro_batches_fixed_returns_contiguous_indices() -> None:
    micro, indices = make_micro_batches(
        _batch_with_lengths([1] * 5), use_dynamic_bsz=False, micro_batch_size=2, max_token_len=1
    )
    assert indices == [[0, 1], [2, 3], [4]] and len(micro) == 3


def test_split_mini_batches_shuffles_reproducibly() -> None:
    data = _batch_with_lengths([1] * 8)
    a = split_mini_batches(data, mini_batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    b = split_mini_batches(data, mini_batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    assert [m.batch["row"].tolist() for m in a] == [m.batch["row"].tolist() for m in b]
    assert sorted(a[0].batch["row"].tolist() + a[1].batch["row"].tolist()) == list(range(8))
    with pytest.raises(ValueError, match="per-rank mini-batch size 3"):
        split_mini_batches(data, mini_batch_size=3, shuffle=False)
