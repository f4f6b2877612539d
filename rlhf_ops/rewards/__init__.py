"""Rule-based reward functions, the registry users extend by dotted path, and token-level placement."""

from rlhf_ops.rewards.manager import compute_token_level_scores
from rlhf_ops.rewards.registry import (
    BUILTIN_REWARD_FNS,
    RewardFn,
    build_reward_fn,
    check_reward_fn,
    load_reward_fn,
)

__all__ = [
    "BUILTIN_REWARD_FNS",
    "RewardFn",
    "build_reward_fn",
    "check_reward_fn",
    "compute_token_level_scores",
    "load_reward_fn",
]
