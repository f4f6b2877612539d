"""The trainer's side of multi-turn rollouts: counters kept from the generation output, metrics per step,
and the reward stage reading the whole multi-turn response."""

from __future__ import annotations

import torch

from rlhf_ops.protocol import DataProto
from rlhf_ops.trainer.generation import gen_keys
from rlhf_ops.trainer.metrics import compute_data_metrics
from rlhf_ops.trainer.reward import decode_responses


def _batch() -> DataProto:
    # Two rows, P = 2, R = 6: row 0 = model, model, tool, tool, model, pad; row 1 single-turn, 3 tokens.
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    attended = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    zeros = torch.zeros(2, 6)
    tensors = {
        "responses": torch.tensor([[10, 11, 20, 21, 12, 0], [13, 14, 15, 0, 0, 0]]),
        "response_mask": response_mask,
        "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), attended], dim=1),
        "token_level_scores": zeros,
        "token_level_rewards": zeros,
        "advantages": zeros,
        "returns": zeros,
        "num_turns": torch.tensor([4, 2]),
        "tool_call_counts": torch.tensor([1, 0]),
        "tool_errors": torch.tensor([1, 0]),
        "tool_timeouts": torch.tensor([1, 0]),
        "interaction_turns": torch.tensor([0, 0]),
        "truncated": torch.tensor([0, 1]),
    }
    return DataProto.from_dict(tensors)


def test_generation_keys_keep_the_counters() -> None:
    keys = gen_keys(_batch())
    assert {"num_turns", "tool_call_counts", "tool_errors", "tool_timeouts", "truncated"} <= set(keys)


def test_step_metrics_use_verl_names() -> None:
    m = compute_data_metrics(_batch(), max_response_length=6, use_critic=False)
    assert (m["num_turns/mean"], m["num_turns/max"], m["num_turns/min"]) == (3.0, 4.0, 2.0)
    assert (m["tool_call_counts/mean"], m["tool_call_counts/max"], m["tool_call_counts/min"]) == (0.5, 1.0, 0.0)
    assert (m["multi_turn/tool_errors"], m["multi_turn/tool_timeouts"], m["multi_turn/truncated_ratio"]) == (1, 1, 0.5)
    assert m["response_length/mean"] == 3.0  # model tokens only: 3 and 3


class _Chars:
    """A tokenizer stand-in that spells ids: decode([10, 11]) == 'k l'."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(chr(ord("a") + i) for i in ids)


def test_reward_stage_decodes_up_to_the_last_attended_token() -> None:
    # Row 0 has 3 model tokens but 5 attended ones: the tool output (20, 21) and the final model token
    # are part of the text the reward function reads (mask.sum() = 3 would stop inside the tool output).
    assert decode_responses(_batch(), _Chars()) == ["k l u v m", "n o p"]
