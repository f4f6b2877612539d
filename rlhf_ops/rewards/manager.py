"""Turns per-response rule scores into token-level scores (verl's ``NaiveRewardManager`` semantics).

Notation: B = number of responses, R = response length (right-padded).

The score of a response sits on its last valid token, all other tokens get 0; the advantage
estimators read ``token_level_scores`` / ``token_level_rewards`` in this layout. Decoding is the
caller's job (it owns the tokenizer), so this module needs only torch.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_ops.padding import last_valid_index
from rlhf_ops.rewards.registry import RewardFn


def _as_float(value: Any, *, fn_name: str, key: str) -> float:
    if isinstance(value, numbers.Real) or (isinstance(value, Tensor) and value.numel() == 1):
        return float(value)
    raise ValueError(
        f"reward function {fn_name} returned {key}={value!r} ({type(value).__name__}); "
        "return a float, or a dict whose values are floats."
    )


def _score_one(
    reward_fn: RewardFn, *, data_source: str, solution: str, truth: str, extra_info: dict[str, Any] | None
) -> tuple[float, dict[str, float]]:
    fn_name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    result = reward_fn(data_source, solution, truth, extra_info)
    if not isinstance(result, dict):
        return _as_float(result, fn_name=fn_name, key="score"), {}
    if "score" not in result:
        raise ValueError(
            f"reward function {fn_name} returned a dict without 'score' (keys {sorted(result)}); add a 'score' key."
        )
    extras = {key: _as_float(val, fn_name=fn_name, key=key) for key, val in result.items()}
    return extras["score"], extras


def compute_token_level_scores(
    responses: Tensor,
    response_mask: Tensor,
    *,
    decoded: Sequence[str],
    data_sources: Sequence[str],
    ground_truths: Sequence[str],
    reward_fn: RewardFn,
    extra_infos: Sequence[dict[str, Any] | None] | None = None,
) -> tuple[Tensor, dict[str, list[float]]]:
    """Scores every response and places the score on its last valid token.

    Args:
        responses: (B, R) response token ids (only the shape and device are used).
        response_mask: (B, R) 1 on model tokens (a prefix, or with holes on a multi-turn response).
        decoded: B decoded responses (valid tokens only, special tokens skipped).
        data_sources: B data sources (list or numpy object array).
        ground_truths: B ground truths.
        reward_fn: The :class:`~rlhf_ops.rewards.registry.RewardFn`.
        extra_infos: B ``extra_info`` dicts, or None for all-None.

    Returns:
        ``(scores, extra)``: ``scores`` (B, R) float32 on ``responses.device`` with
        ``scores[i, j] = score_i`` where ``j`` is the last column with ``response_mask[i, j] = 1`` (the model's
        last token, also after observation spans of a multi-turn response; column 0 when a row has no valid
        token, where masking drops it); ``extra`` maps every key of dict results (``"score"``
        included) to B floats, like verl's ``reward_extra_info``; empty when the function returns floats.

    Raises:
        ValueError: on length mismatches, a dict without ``"score"``, non-float values, or dict results
            whose keys differ between rows.
    """
    batch = responses.shape[0]
    if responses.dim() != 2 or response_mask.shape != responses.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} must be (B, R)."
        )
    columns: dict[str, Sequence[Any]] = {
        "decoded": decoded,
        "data_sources": data_sources,
        "ground_truths": ground_truths,
    }
    if extra_infos is not None:
        columns["extra_infos"] = extra_infos
    for name, column in columns.items():
        if len(column) != batch:
            raise ValueError(f"{name} has {len(column)} entries but responses have B={batch}; pass one per response.")
    scores: list[float] = []
    extras: list[dict[str, float]] = []
    for i in range(batch):
        info = None if extra_infos is None else extra_infos[i]
        score, extra = _score_one(
            reward_fn,
            data_source=str(data_sources[i]),
            solution=decoded[i],
            truth=str(ground_truths[i]),
            extra_info=info,
        )
        scores.append(score)
        extras.append(extra)
    keys = set(extras[0]) if extras else set()
    if any(set(e) != keys for e in extras):
        raise ValueError(
            "reward function returned dicts with different keys across rows; return the same keys always."
        )
    last = last_valid_index(response_mask)  # (B,) the last model token, also when the mask has holes
    token_scores = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
    token_scores[torch.arange(batch, device=responses.device), last.to(responses.device)] = torch.tensor(
        scores, dtype=torch.float32, device=responses.device
    )
    return token_scores, {key: [e[key] for e in extras] for key in sorted(keys)}
