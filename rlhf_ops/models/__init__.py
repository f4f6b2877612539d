"""Model builders: the tiny Llama-style policy / reward model used by tests, demos and the learning test."""

from rlhf_ops.models.tiny import (
    TINY_MODEL_DEFAULTS,
    build_tiny_model_dir,
    build_tiny_reward_model_dir,
    build_tiny_tokenizer,
)

__all__ = ["TINY_MODEL_DEFAULTS", "build_tiny_model_dir", "build_tiny_reward_model_dir", "build_tiny_tokenizer"]
