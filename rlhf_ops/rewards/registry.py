"""The rule-based reward contract and how a reward function is named in config.

A reward function has verl's ``compute_score`` signature (:class:`RewardFn`). Config names one by a
built-in name (a key of :data:`BUILTIN_REWARD_FNS`) or by a dotted path to user code, resolved by
:func:`load_reward_fn`: ``"my_pkg.rewards:score"`` or ``"my_pkg.rewards.score"``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, cast, runtime_checkable

from rlhf_ops.rewards.toy import add_digits_score, color_name_score, copy_digit_score, toy_compute_score


@runtime_checkable
class RewardFn(Protocol):
    """Scores one decoded response (verl's ``compute_score`` signature).

    Args:
        data_source: The row's ``data_source`` (lets one function serve several datasets).
        solution_str: The decoded response, special tokens skipped.
        ground_truth: The row's ``ground_truth``.
        extra_info: The row's ``extra_info`` if the dataset has one, else None.

    Returns:
        A float, or a dict with a ``"score"`` float and any other float metrics (e.g. ``"acc"``).
    """

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
    ) -> float | dict[str, Any]: ...


BUILTIN_REWARD_FNS: dict[str, RewardFn] = {
    "toy": toy_compute_score,
    "copy_digit": copy_digit_score,
    "add_digits": add_digits_score,
    "color_name": color_name_score,
}


def load_reward_fn(spec: str) -> RewardFn:
    """Resolves a built-in name or a dotted path to a reward function.

    Args:
        spec: ``"toy"`` (a key of :data:`BUILTIN_REWARD_FNS`), ``"pkg.module:function"`` or
            ``"pkg.module.function"``. The part after ``:`` may itself be dotted (``"pkg.mod:Class.method"``).

    Returns:
        The callable.

    Raises:
        ValueError: if the name is unknown, the module cannot be imported, the attribute is missing or
            not callable; the message names ``spec`` and the fix.
    """
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    else:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(
            f"reward function {spec!r} is neither a built-in ({sorted(BUILTIN_REWARD_FNS)}) nor a dotted path; "
            "use a built-in name or 'package.module:function'."
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward function {spec!r}: cannot import module {module_name!r} ({err}); install the package or put "
            "it on PYTHONPATH of every worker, or fix the spelling ('package.module:function')."
        ) from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward function {spec!r}: module {module_name!r} has no attribute {attr_path!r}; "
                "fix the name after the module ('package.module:function')."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"reward function {spec!r} resolves to a {type(obj).__name__}, which is not callable; point it at a "
            "function (data_source, solution_str, ground_truth, extra_info) -> float | dict."
        )
    return cast(RewardFn, obj)
