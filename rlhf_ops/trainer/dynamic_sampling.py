"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476; verl's ``algorithm.filter_groups``).

A group (the n samples of one prompt) whose samples all score the same has zero advantage under a group
estimator (GRPO / RLOO / ...): it adds no gradient but still dilutes token-mean losses and costs the update.
Dynamic sampling drops those groups and generates from the next prompts until the step holds
``data.train_batch_size`` informative groups, or ``max_num_gen_batches`` rounds have run; then the step is
filled up with dropped groups (so the batch plan's sizes hold) and ``filled_groups`` says how many.

Notation: B = sequences (groups x n), P = prompt length of one round's batch (rounds may differ), R = response.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlhf_ops.protocol import DataProto

__all__ = ["ScoredBatch", "fill_dynamic_batch", "group_keep_mask", "left_pad_to"]

# Tensors with the prompt on the left (left-padded) and whether their padding is the pad token (else 0):
# widened on the left when rounds of different prompt widths are concatenated.
_LEFT_PADDED = {"prompts": True, "input_ids": True, "attention_mask": False, "position_ids": False}


@dataclass
class ScoredBatch:
    """One generation round after the reward stage: the batch and the reward function's per-row extras."""

    batch: DataProto
    extra: dict[str, list[float]]


def group_keep_mask(values: Tensor, uids: Sequence[object]) -> Tensor:
    """(B,) True on rows of groups whose ``values`` are not all equal (a group = the rows sharing a uid).

    Args:
        values: (B,) one value per sequence (its score, or its accuracy).
        uids: (B,) group id of each sequence.
    """
    keep = torch.zeros(len(uids), dtype=torch.bool)
    groups: dict[object, list[int]] = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    for rows in groups.values():
        group = values[rows]
        keep[rows] = bool((group != group[0]).any())
    return keep


def _metric_values(scored: ScoredBatch, metric: str) -> Tensor:
    if metric == "score":
        return scored.batch.tensors["token_level_scores"].sum(-1)
    if metric not in scored.extra:
        raise ValueError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no such key (it returned "
            f"{sorted(scored.extra) or 'a plain score'}); set metric=score or return {metric!r} in its dict."
        )
    return torch.as_tensor(scored.extra[metric], dtype=torch.float64)


def left_pad_to(batch: DataProto, width: int, *, pad_token_id: int) -> DataProto:
    """``batch`` with its left-padded tensors (prompts, input_ids, attention_mask, position_ids) widened to
    ``width`` prompt columns by padding on the left; other tensors are unchanged."""
    tensors: dict[str, Tensor] = {str(k): v for k, v in batch.tensors.items() if isinstance(v, Tensor)}
    extra = width - tensors["prompts"].shape[-1]
    if extra <= 0:
        return batch
    for key, is_token in _LEFT_PADDED.items():
        if key in tensors:
            t = tensors[key]
            pad = torch.full((t.shape[0], extra), pad_token_id if is_token else 0, dtype=t.dtype, device=t.device)
            tensors[key] = torch.cat([pad, t], dim=-1)
    return DataProto.from_dict(
        tensors=tensors, non_tensors=dict(batch.non_tensor_batch), meta_info=dict(batch.meta_info)
    )


def _concat(parts: list[DataProto], *, pad_token_id: int) -> DataProto:
    width = max(p.tensors["prompts"].shape[-1] for p in parts)
    return DataProto.concat([left_pad_to(p, width, pad_token_id=pad_token_id) for p in parts])


def _rows_of_groups(uids: Sequence[object], num_groups: int) -> list[int]:
    """Rows of the first ``num_groups`` groups in order of first appearance (whole groups only)."""
    chosen: list[object] = []
    for uid in uids:
        if uid not in chosen:
            chosen.append(uid)
        if len(chosen) == num_groups:
            break
    wanted = set(chosen)
    return [i for i, uid in enumerate(uids) if uid in wanted]


def fill_dynamic_batch(
    first: ScoredBatch,
    next_round: Callable[[], ScoredBatch],
    *,
    num_groups: int,
    metric: str,
    max_rounds: int,
    pad_token_id: int,
) -> tuple[DataProto, dict[str, float]]:
    """A batch of exactly ``num_groups`` groups, informative ones first (see the module docstring).

    Args:
        first: The step's own round (its prompts generated and scored).
        next_round: Generates and scores the next prompts of the loader (one more round).
        num_groups: Groups the step must hold (``data.train_batch_size``).
        metric: ``score`` (summed ``token_level_scores``) or a reward-function extra key (e.g. ``acc``).
        max_rounds: Rounds at most, the first included (``algorithm.filter_groups.max_num_gen_batches``).
        pad_token_id: Fills the prompt side when rounds of different prompt widths are joined.

    Returns:
        ``(batch, metrics)``: metrics ``train/dynamic_sampling/{gen_rounds, kept_group_frac, filled_groups}``:
        rounds run, the share of generated groups that were informative, groups taken from the dropped ones.

    Raises:
        ValueError: ``metric`` is neither ``score`` nor a key of the reward function's extras.
    """
    kept: list[DataProto] = []
    dropped: list[DataProto] = []
    kept_groups = seen_groups = rounds = 0
    scored: ScoredBatch | None = first
    while True:
        rounds += 1
        current = scored if scored is not None else next_round()
        scored = None
        uids = list(current.batch.non_tensor_batch["uid"])
        keep = group_keep_mask(_metric_values(current, metric), uids)
        idx = np.arange(len(uids))
        kept.append(current.batch[idx[keep.numpy()]])
        dropped.append(current.batch[idx[~keep.numpy()]])
        kept_groups += len({u for u, k in zip(uids, keep.tolist(), strict=True) if k})
        seen_groups += len(set(uids))
        if kept_groups >= num_groups or rounds >= max_rounds:
            break
    filled = max(0, num_groups - kept_groups)
    parts = [p for p in kept if len(p)] + ([p for p in dropped if len(p)] if filled else [])
    joined = _concat(parts, pad_token_id=pad_token_id)
    batch = joined[_rows_of_groups(list(joined.non_tensor_batch["uid"]), num_groups)]
    metrics = {
        "train/dynamic_sampling/gen_rounds": float(rounds),
        "train/dynamic_sampling/kept_group_frac": kept_groups / max(seen_groups, 1),
        "train/dynamic_sampling/filled_groups": float(filled),
    }
    return batch, metrics
