"""DAPO dynamic sampling: drop zero-variance groups, refill from the next prompts, cap the rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_ops.protocol import DataProto
from rlhf_ops.trainer.dynamic_sampling import ScoredBatch, fill_dynamic_batch, group_keep_mask

PAD = 0


def _round(groups: dict[str, list[float]], *, prompt_width: int, acc: list[float] | None = None) -> ScoredBatch:
    """n = 2 samples per group, responses of 2 tokens; the score sits on the last response token."""
    uids = [u for u, scores in groups.items() for _ in scores]
    scores = [s for group in groups.values() for s in group]
    b = len(uids)
    prompts = torch.arange(1, b * prompt_width + 1).view(b, prompt_width)
    responses = torch.full((b, 2), 7)
    token_scores = torch.zeros(b, 2)
    token_scores[:, -1] = torch.tensor(scores)
    attention = torch.ones(b, prompt_width + 2, dtype=torch.long)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": attention,
            "position_ids": attention.cumsum(-1) - 1,
            "response_mask": torch.ones(b, 2, dtype=torch.long),
            "token_level_scores": token_scores,
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    return ScoredBatch(batch, {"acc": acc} if acc is not None else {})


def test_group_keep_mask_keeps_groups_with_different_values():
    keep = group_keep_mask(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), ["a", "a", "b", "b", "c", "c"])
    assert keep.tolist() == [False, False, True, True, False, False]


def test_refills_from_the_next_round_and_pads_prompts_on_the_left():
    # Round 1: a all equal (dropped), b mixed (kept). Round 2 (prompts 3 wide, not 2): c mixed, d equal.
    first = _round({"a": [1.0, 1.0], "b": [0.0, 1.0]}, prompt_width=2)
    second = _round({"c": [1.0, 0.0], "d": [0.0, 0.0]}, prompt_width=3)
    calls: list[int] = []

    def next_round() -> ScoredBatch:
        calls.append(1)
        return second

    batch, metrics = fill_dynamic_batch(
        first, next_round, num_groups=2, metric="score", max_rounds=4, pad_token_id=PAD
    )
    assert list(batch.non_tensor_batch["uid"]) == ["b", "b", "c", "c"] and len(calls) == 1
    assert metrics == {
        "train/dynamic_sampling/gen_rounds": 2.0,
        "train/dynamic_sampling/kept_group_frac": 0.5,  # 2 informative groups of 4 generated
        "train/dynamic_sampling/filled_groups": 0.0,
    }
    t = batch.tensors
    # b's rows (prompts [[5, 6], [7, 8]] of round 1) gain one pad column on the left; c's are unchanged.
    assert t["prompts"][:2].tolist() == [[PAD, 5, 6], [PAD, 7, 8]]
    assert t["attention_mask"][:2, 0].tolist() == [0, 0] and t["input_ids"].shape == (4, 5)
    assert t["prompts"][2:].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_the_round_cap_fills_up_with_dropped_groups():
    first = _round({"a": [1.0, 1.0], "b": [0.0, 1.0]}, prompt_width=2)
    batch, metrics = fill_dynamic_batch(
        first,
        lambda: pytest.fail("no second round under the cap"),
        num_groups=2,
        metric="score",
        max_rounds=1,
        pad_token_id=PAD,
    )
    assert list(batch.non_tensor_batch["uid"]) == ["b", "b", "a", "a"]
    assert metrics["train/dynamic_sampling/filled_groups"] == 1.0
    assert metrics["train/dynamic_sampling/gen_rounds"] == 1.0


def test_extra_metric_and_its_error():
    # Scores differ within both groups, accuracies only within b: filtering on acc keeps b alone.
    first = _round({"a": [0.5, 1.0], "b": [0.0, 1.0]}, prompt_width=2, acc=[1.0, 1.0, 0.0, 1.0])
    batch, metrics = fill_dynamic_batch(
        first, lambda: first, num_groups=1, metric="acc", max_rounds=2, pad_token_id=PAD
    )
    assert list(batch.non_tensor_batch["uid"]) == ["b", "b"] and metrics["train/dynamic_sampling/gen_rounds"] == 1.0
    with pytest.raises(ValueError, match="filter_groups.metric='acc'.*set metric=score"):
        fill_dynamic_batch(
            _round({"a": [0.0, 1.0]}, prompt_width=2),
            lambda: first,
            num_groups=1,
            metric="acc",
            max_rounds=1,
            pad_token_id=PAD,
        )
