"""Rule-based reward functions, the registry users extend by dotted path, and token-level placement."""

from typing import Any

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


def __getattr__(name: str) -> Any:
    # manager needs torch; resolving a reward function must not (pre-flight runs in the Airflow worker)
    if name == "compute_token_level_scores":
        from rlhf_ops.rewards.manager import compute_token_level_scores

        return compute_token_level_scores
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
