"""The reward-function table (``reward.reward_fn``): verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info)`` functions by name.

A built-in is a function under ``rlhf_ops.rewards`` with :func:`reward_function` on it: the table reads the
decorator from the source (no import). Rule rewards need no traits beyond their signature (checked at pre-flight by
:func:`rlhf_ops.rewards.registry.check_reward_fn`). Beyond the built-ins, a reward is selected by a dotted
path in the config (``reward.reward_fn=my_pkg.rewards:score``: nothing to register) or by the name an
installed package gives it in the ``rlhf_ops.reward_functions`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlhf_ops.extensions.declared import Declaration, declare
from rlhf_ops.extensions.table import Entry, Table

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True)
class RewardFunction(Entry):
    """A rule-based reward function (``reward.reward_fn``)."""


def reward_from_callable(name: str, fn: Any) -> RewardFunction:
    """A plain ``compute_score`` function (what a dotted path or an entry point usually names)."""
    return RewardFunction(name=name, target=fn)


def _reward_entries(d: Declaration) -> list[RewardFunction]:
    return [RewardFunction(name=d.args[0], target=d.target, description=d.kwargs.get("description") or d.doc)]


REWARD_FUNCTIONS: Table[RewardFunction] = Table(
    what="reward function",
    key="reward.reward_fn",
    entry_type=RewardFunction,
    group="rlhf_ops.reward_functions",
    from_callable=reward_from_callable,
    declared_in=("rlhf_ops.rewards.*",),
    decorator="reward_function",
    build=_reward_entries,
)


def reward_function(name: str, *, description: str = "") -> Callable[[F], F]:
    """Declares the decorated ``compute_score`` the reward function ``name``: built in under
    ``rlhf_ops.rewards`` (the table reads the decorator from the source), registered on import elsewhere."""
    return declare(REWARD_FUNCTIONS, _reward_entries, name, description=description)
