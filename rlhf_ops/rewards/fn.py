"""The reward function Protocol (its own module: the registry and the wrappers it registers both use it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RewardFn(Protocol):
    """Scores one decoded response (verl's ``compute_score`` signature).

    Args:
        data_source: The row's ``data_source`` (lets one function serve several datasets).
        solution_str: The decoded response, special tokens skipped.
        ground_truth: The row's ``ground_truth``.
        extra_info: The row's ``extra_info`` dict (``{}`` when the data has none) plus ``"response_length"``
            (valid response tokens) from the trainer's reward stage; None when a caller has no row data.

    Returns:
        A float, or a dict with a ``"score"`` float and any other float metrics (e.g. ``"acc"``).
    """

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None
    ) -> float | dict[str, Any]: ...
