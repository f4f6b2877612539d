"""The reward-function table (``reward.reward_fn``): verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info)`` functions by name.

Rule rewards need no traits beyond their signature (checked at pre-flight by
:func:`rlhf_ops.rewards.registry.check_reward_fn`). Beyond the built-ins, a reward is selected by a dotted
path in the config (``reward.reward_fn=my_pkg.rewards:score``: nothing to register) or by the name an
installed package gives it in the ``rlhf_ops.reward_functions`` entry-point group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_ops.extensions.table import Entry, Table


@dataclass(frozen=True, kw_only=True)
class RewardFunction(Entry):
    """A rule-based reward function (``reward.reward_fn``)."""


def reward_from_callable(name: str, fn: Any) -> RewardFunction:
    """A plain ``compute_score`` function (what a dotted path or an entry point usually names)."""
    return RewardFunction(name=name, target=fn)


_R = "rlhf_ops.rewards"
REWARD_FUNCTIONS: Table[RewardFunction] = Table(
    what="reward function",
    key="reward.reward_fn",
    entry_type=RewardFunction,
    group="rlhf_ops.reward_functions",
    from_callable=reward_from_callable,
    entries=[
        RewardFunction(
            name="default", target=f"{_R}.default:default_compute_score", description="Dispatch on data_source."
        ),
        RewardFunction(name="gsm8k", target=f"{_R}.gsm8k:gsm8k_score", description="GSM8K, strict '#### N'."),
        RewardFunction(
            name="gsm8k_flexible", target=f"{_R}.gsm8k:gsm8k_flexible_score", description="GSM8K, last number."
        ),
        RewardFunction(name="math", target=f"{_R}.math_answer:math_score", description="MATH, \\boxed{} answer."),
        RewardFunction(
            name="multiple_choice",
            target=f"{_R}.multiple_choice:multiple_choice_score",
            description="The option letter.",
        ),
        RewardFunction(name="format", target=f"{_R}.default:format_score", description="Answer format only."),
        RewardFunction(name="toy", target=f"{_R}.toy:toy_compute_score", description="The toy tasks, by source."),
        RewardFunction(name="copy_digit", target=f"{_R}.toy:copy_digit_score", description="Toy: copy a digit."),
        RewardFunction(name="add_digits", target=f"{_R}.toy:add_digits_score", description="Toy: add two digits."),
        RewardFunction(name="color_name", target=f"{_R}.toy:color_name_score", description="Toy: name a colour."),
    ],
)
