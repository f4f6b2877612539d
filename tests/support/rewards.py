"""Reward functions for learning tests, named by dotted path (``tests.support.rewards:starts_with_five``)."""

from __future__ import annotations

from typing import Any


def starts_with_five(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """1.0 if the decoded response starts with ``"5"``, else 0.0 (the prompt and ground truth are ignored).

    A one-token bandit: the tiny random-init model (84-token vocabulary) starts with ``"5"`` about 1% of the
    time, so a GRPO group of 16 samples often holds a rewarded one, and the policy only has to raise one
    token's probability at the first response position, whatever the prompt.
    """
    return 1.0 if solution_str.startswith("5") else 0.0
