"""The driver's reward stage: rule functions (on decoded text) plus reward-model scores, summed.

Notation: B = sequences, R = response length.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_ops.protocol import DataProto
from rlhf_ops.rewards import RewardFn, compute_token_level_scores
from rlhf_ops.rewards.length import RESPONSE_LENGTH_KEY
from rlhf_ops.trainer.roles import RewardModel, Tokenizer


def row_extra_infos(data: DataProto) -> list[dict[str, Any]]:
    """Each row's ``extra_info`` (a copy; ``{}`` when the data has none) plus ``"response_length"``.

    ``response_length`` is the row's count of valid response tokens; length-aware rewards (the overlong
    penalty) read it from here, as verl's reward managers pass ``valid_response_length``.
    """
    lengths = data.tensors["response_mask"].sum(-1).tolist()
    infos = data.non_tensor_batch.get("extra_info")
    rows = [None] * len(lengths) if infos is None else list(infos)
    return [{**(info or {}), RESPONSE_LENGTH_KEY: int(n)} for info, n in zip(rows, lengths, strict=True)]


def decode_responses(data: DataProto, tokenizer: Tokenizer) -> list[str]:
    """Each row's response up to its last attended token as text (special tokens skipped).

    The attended span is the response part of ``attention_mask``: model tokens and, in a multi-turn
    response, the tool outputs between them (``response_mask`` has holes there); single-turn it equals
    ``response_mask``.
    """
    responses = data.tensors["responses"]
    if "attention_mask" in data.tensors.keys():
        lengths = data.tensors["attention_mask"][:, -responses.shape[1] :].sum(-1).tolist()
    else:  # a batch of responses only (single-turn): the same span
        lengths = data.tensors["response_mask"].sum(-1).tolist()
    return [
        tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True)
        for row, n in zip(responses, lengths, strict=True)
    ]


class RewardStage:
    """``token_level_scores`` (B, R) (and ``rm_scores`` with a reward model), plus per-row extras for metrics."""

    def __init__(self, *, tokenizer: Tokenizer, reward_fn: RewardFn | None, reward_model: RewardModel | None) -> None:
        if reward_fn is None and reward_model is None:
            raise ValueError("reward: set reward.reward_fn and/or reward.model_path")
        self.tokenizer, self.reward_fn, self.reward_model = tokenizer, reward_fn, reward_model

    def __call__(self, data: DataProto) -> dict[str, list[float]]:
        """Writes :meth:`score`'s tensors into ``data`` (for callers holding one batch); returns the extras."""
        tensors, extra = self.score(data)
        for key, value in tensors.items():
            data.tensors[key] = value
        return extra

    def score(self, data: DataProto) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
        """``({"token_level_scores": (B, R)[, "rm_scores": (B, R)]}, extras)``; ``data`` is not changed."""
        added: dict[str, torch.Tensor] = {}
        scores = torch.zeros_like(data.tensors["response_mask"], dtype=torch.float32)
        extra: dict[str, list[float]] = {}
        if self.reward_fn is not None:
            rule, extra = compute_token_level_scores(
                data.tensors["responses"],
                data.tensors["response_mask"],
                decoded=decode_responses(data, self.tokenizer),
                data_sources=list(data.non_tensor_batch["data_source"]),
                ground_truths=list(data.non_tensor_batch["ground_truth"]),
                reward_fn=self.reward_fn,
                extra_infos=row_extra_infos(data),
            )
            scores = scores + rule
        if self.reward_model is not None:
            rm = self.reward_model.compute_rm_score(data.select(batch_keys=_RM_KEYS))
            added["rm_scores"] = rm.tensors["rm_scores"]
            scores = scores + rm.tensors["rm_scores"]
        added["token_level_scores"] = scores
        return added, extra


_RM_KEYS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
