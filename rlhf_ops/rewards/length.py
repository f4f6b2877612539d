"""DAPO's soft overlong punishment, as a wrapper around any reward function.

With ``L`` the response length in tokens, ``L_max = max_response_length`` and ``B = buffer_len``, the
penalty added to the score is (DAPO, Yu et al. 2025, eq. 13; verl's ``overlong_buffer``)::

    0                                   if L <= L_max - B
    -(L - (L_max - B)) / B * factor     otherwise  (reaches -factor at L = L_max)

so responses that run into the last ``B`` tokens of the budget lose reward linearly instead of being
cut off with the same score as a finished one. The length comes from ``extra_info["response_length"]``
(the reward stage puts it there for every row).
"""

from __future__ import annotations

from typing import Any

from rlhf_ops.rewards.fn import RewardFn

RESPONSE_LENGTH_KEY = "response_length"


def overlong_penalty(
    response_length: int, *, max_response_length: int, buffer_len: int, penalty_factor: float
) -> float:
    """The (non-positive) penalty of one response; see the module docstring."""
    expected = max_response_length - buffer_len
    return min(-(response_length - expected) / buffer_len * penalty_factor, 0.0)


class OverlongPenalty:
    """``reward_fn`` with :func:`overlong_penalty` added to its score.

    A class rather than a closure so the wrapped function pickles (Ray) and names itself in errors.
    Results are dicts: the wrapped function's keys (``"score"`` penalised, the others, e.g. ``"acc"``,
    untouched) plus ``"overlong_reward"`` (the penalty) and ``"overlong"`` (1.0 inside the buffer).
    """

    def __init__(self, reward_fn: RewardFn, *, max_response_length: int, buffer_len: int, penalty_factor: float):
        if not 0 < buffer_len <= max_response_length:
            raise ValueError(
                f"reward.overlong_buffer.len={buffer_len} must be in 1..{max_response_length} "
                "(rollout.max_new_tokens); lower it or raise rollout.max_new_tokens."
            )
        if penalty_factor < 0:
            raise ValueError(f"reward.overlong_buffer.penalty_factor={penalty_factor} must be >= 0.")
        self.reward_fn, self.max_response_length = reward_fn, max_response_length
        self.buffer_len, self.penalty_factor = buffer_len, penalty_factor
        self.__qualname__ = f"OverlongPenalty({getattr(reward_fn, '__qualname__', repr(reward_fn))})"

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        length = (extra_info or {}).get(RESPONSE_LENGTH_KEY)
        if not isinstance(length, int):
            raise ValueError(
                f"{self.__qualname__}: extra_info[{RESPONSE_LENGTH_KEY!r}] is {length!r}; the overlong penalty "
                "needs the response length in tokens (the trainer's reward stage sets it)."
            )
        result = self.reward_fn(data_source, solution_str, ground_truth, extra_info)
        out: dict[str, Any] = dict(result) if isinstance(result, dict) else {"score": result}
        penalty = overlong_penalty(
            length,
            max_response_length=self.max_response_length,
            buffer_len=self.buffer_len,
            penalty_factor=self.penalty_factor,
        )
        out.update(score=float(out["score"]) + penalty, overlong_reward=penalty, overlong=float(penalty < 0))
        return out
