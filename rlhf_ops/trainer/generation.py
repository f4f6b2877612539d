"""What the training step and validation share about a rollout's output (one module, so neither imports the other)."""

from __future__ import annotations

from rlhf_ops.protocol import DataProto


def merge_generation(prompts: DataProto, generated: DataProto, *, keys: list[str]) -> DataProto:
    """The generated tensors (full sequences replace the prompt-only ones) with the prompts' columns."""
    tensors = generated.select(batch_keys=keys).tensors
    return DataProto.from_dict(
        tensors={key: tensors[key] for key in keys},
        non_tensors=dict(prompts.non_tensor_batch),
        meta_info=dict(prompts.meta_info),
    )
