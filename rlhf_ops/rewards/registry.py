"""The rule-based reward contract and how a reward function is named in config.

A reward function has verl's ``compute_score`` signature (:class:`RewardFn`). Config names one by a
built-in name (a key of :data:`BUILTIN_REWARD_FNS`) or by a dotted path to user code, resolved by
:func:`load_reward_fn`: ``"my_pkg.rewards:score"`` or ``"my_pkg.rewards.score"``.
:func:`check_reward_fn` also refuses a function whose signature cannot take the four arguments (pre-flight
calls it, so a wrong signature fails before any worker starts); :func:`build_reward_fn` adds the
optional overlong penalty (:mod:`rlhf_ops.rewards.length`).

Built-ins: ``gsm8k`` (strict ``#### N``), ``gsm8k_flexible`` (last number), ``math`` (``\\boxed{}``),
``multiple_choice`` (option letter), ``format`` (answer format only), ``default`` (dispatch on
``data_source``, :mod:`rlhf_ops.rewards.default`) and the toy tasks' ``toy``, ``copy_digit``, ``add_digits``.
"""

from __future__ import annotations

import inspect
from typing import cast

from rlhf_ops.code_policy import import_dotted
from rlhf_ops.extensions.rewards import REWARD_FUNCTIONS
from rlhf_ops.rewards.fn import RewardFn
from rlhf_ops.rewards.length import OverlongPenalty

# The built-in entries of the table (rlhf_ops.extensions.REWARD_FUNCTIONS), name -> function.
BUILTIN_REWARD_FNS: dict[str, RewardFn] = {entry.name: entry.load() for entry in REWARD_FUNCTIONS}


def load_reward_fn(spec: str) -> RewardFn:
    """Resolves a built-in name or a dotted path to a reward function.

    Args:
        spec: ``"toy"`` (a key of :data:`BUILTIN_REWARD_FNS`), ``"pkg.module:function"`` or
            ``"pkg.module.function"``. The part after ``:`` may itself be dotted (``"pkg.mod:Class.method"``).

    Returns:
        The callable.

    Raises:
        ValueError: if the name is unknown, the module is not on the operator's allow-list
            (:mod:`rlhf_ops.code_policy`, a ``CodeNotAllowedError``), the module cannot be imported, the
            attribute is missing or not callable; the message names ``spec`` and the fix.
    """
    if spec in BUILTIN_REWARD_FNS:
        return BUILTIN_REWARD_FNS[spec]
    if ":" not in spec and spec in REWARD_FUNCTIONS:  # registered, or an installed package's entry point
        return cast(RewardFn, REWARD_FUNCTIONS.get(spec).load())
    obj = import_dotted(
        spec, what="reward function", example="package.module:function", builtins=sorted(BUILTIN_REWARD_FNS)
    )
    if not callable(obj):
        raise ValueError(
            f"reward function {spec!r} resolves to a {type(obj).__name__}, which is not callable; point it at a "
            "function (data_source, solution_str, ground_truth, extra_info) -> float | dict."
        )
    return cast(RewardFn, obj)


REWARD_FN_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")
_PROBE = dict.fromkeys(REWARD_FN_PARAMETERS, "")


def check_reward_fn(spec: str) -> RewardFn:
    """Loads ``reward.reward_fn`` and checks that it accepts verl's four arguments; no call is made.

    The signature must bind both ways the platform and verl call a reward function: positionally
    ``fn(data_source, solution_str, ground_truth, extra_info)`` and by keyword with those names
    (verl's reward managers pass keywords). Extra parameters need defaults; ``*args`` / ``**kwargs``
    absorb anything. Callables whose signature Python cannot read (some C extensions) are accepted.

    Args:
        spec: As :func:`load_reward_fn`.

    Returns:
        The callable.

    Raises:
        ValueError: one line naming ``reward.reward_fn``, the problem and the fix (unknown name, import
            error, missing attribute, not callable, wrong signature).
    """
    try:
        fn = load_reward_fn(spec)
    except ValueError as err:
        raise ValueError(f"reward.reward_fn: {err}") from err
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no introspectable signature: only a call could tell
        return fn
    for how, bind in (
        ("positionally", lambda: signature.bind(*_PROBE.values())),
        ("by keyword", lambda: signature.bind(**_PROBE)),
    ):
        try:
            bind()
        except TypeError as err:
            raise ValueError(
                f"reward.reward_fn={spec!r}: {getattr(fn, '__qualname__', spec)}{signature} cannot be called "
                f"{how} with (data_source, solution_str, ground_truth, extra_info): {err}; define it as "
                "def fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict."
            ) from err
    return fn


def build_reward_fn(
    spec: str,
    *,
    max_response_length: int,
    overlong_buffer_len: int | None = None,
    overlong_penalty_factor: float = 1.0,
) -> RewardFn:
    """The reward function the trainer calls: :func:`check_reward_fn`, optionally with the overlong penalty.

    Args:
        spec: ``reward.reward_fn``.
        max_response_length: ``rollout.max_new_tokens`` (L_max of the penalty).
        overlong_buffer_len: ``reward.overlong_buffer.len`` when ``reward.overlong_buffer.enable``, else None.
        overlong_penalty_factor: ``reward.overlong_buffer.penalty_factor``.

    Raises:
        ValueError: as :func:`check_reward_fn`, or on a buffer outside ``1..max_response_length``.
    """
    fn = check_reward_fn(spec)
    if overlong_buffer_len is None:
        return fn
    return OverlongPenalty(
        fn,
        max_response_length=max_response_length,
        buffer_len=overlong_buffer_len,
        penalty_factor=overlong_penalty_factor,
    )
