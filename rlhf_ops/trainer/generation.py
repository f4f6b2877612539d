"""The generated batch of a rollout call: the engine's tensors with the prompts' columns.

Notation: B = rows (prompts x n after repeating), P = prompt length, T = P + R.
"""

from __future__ import annotations

from rlhf_ops.agent.metrics import ROW_KEYS
from rlhf_ops.protocol import DataProto

GEN_KEYS = [
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
]
MEDIA_KEYS = ["pixel_values"]  # vision-language batches: the images travel with their rows to every role
MULTI_TURN_KEYS = ROW_KEYS  # multi-turn rollouts: per-row turn / tool counters (rlhf_ops.agent.metrics)


def gen_keys(generated: DataProto) -> list[str]:
    """The generation keys to keep: :data:`GEN_KEYS` plus the media and multi-turn keys the engine returned."""
    present = set(generated.tensors.keys())
    return GEN_KEYS + [k for k in (*MEDIA_KEYS, *MULTI_TURN_KEYS) if k in present]


def merge_generation(prompts: DataProto, generated: DataProto, *, keys: list[str]) -> DataProto:
    """The generated tensors (full sequences (B, T) replace the prompt-only ones) with the prompts' columns."""
    tensors = generated.select(batch_keys=keys).tensors
    return DataProto.from_dict(
        tensors={key: tensors[key] for key in keys},
        non_tensors=dict(prompts.non_tensor_batch),
        meta_info=dict(prompts.meta_info),
    )
