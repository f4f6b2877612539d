"""Multiple-choice reward: the chosen option letter (A-J) against the ground truth's letter.

The choice of a response is, first match wins:

1. the last explicit statement: ``answer is (B)``, ``Answer: B``, ``answer: **B**``, ``\\boxed{B}``;
2. a response that opens with the letter alone: ``"B"``, ``"B."``, ``"(B) Paris"``, ``"B) Paris"``,
   ``"B: Paris"``.

A letter inside prose (``"A good guess is C"``) is not a choice, so a response cannot win by listing
letters. The ground truth is a letter (``"B"``, ``"b"``, ``"(B)"``), or an option index (``"1"`` = B)
when ``extra_info["choices"]`` lists the options.
"""

from __future__ import annotations

import re
from typing import Any

from rlhf_ops.extensions.rewards import reward_function

LETTERS = "ABCDEFGHIJ"
# Keywords in any case, the letter in upper case only ("the answer is a dog" picks nothing).
_EXPLICIT = re.compile(
    r"(?i:answer(?:\s+is)?|choice(?:\s+is)?|option(?:\s+is)?)\s*:?\s*[*(\[]*\s*([A-J])\b"
    r"|\\boxed\{\s*(?:\\text\{)?\s*([A-J])\s*\}?\s*\}"
)
_LEADING = re.compile(r"^\s*[*(\[]*([A-J])(?:[)\].:]|\s*$|\s*\))")


def extract_choice(solution_str: str) -> str | None:
    """The option letter a response picks (upper case), or None; see the module docstring."""
    explicit = [m.group(1) or m.group(2) for m in _EXPLICIT.finditer(solution_str)]
    letters = [x.upper() for x in explicit if x]
    if letters:
        return letters[-1]
    leading = _LEADING.match(solution_str)
    return leading.group(1) if leading else None


def truth_letter(ground_truth: str, extra_info: dict[str, Any] | None) -> str:
    """The ground truth as a letter; a digit is an option index when ``extra_info["choices"]`` exists."""
    text = ground_truth.strip().strip("()[]. ").upper()
    if text.isdigit() and extra_info and isinstance(extra_info.get("choices"), list):
        index = int(text)
        if not 0 <= index < len(extra_info["choices"]) or index >= len(LETTERS):
            raise ValueError(
                f"multiple_choice: ground_truth={ground_truth!r} is no index into the "
                f"{len(extra_info['choices'])} extra_info['choices']; store the letter or a valid index."
            )
        return LETTERS[index]
    if len(text) != 1 or text not in LETTERS:
        raise ValueError(
            f"multiple_choice: ground_truth={ground_truth!r} is not an option letter A-J; store the letter "
            "(or a 0-based index with extra_info['choices'])."
        )
    return text


@reward_function("multiple_choice", description="The option letter.")
def multiple_choice_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward ``multiple_choice``: 1.0 iff the response's choice is the ground truth's letter.

    Returns:
        ``{"score", "acc"}``, equal.

    Raises:
        ValueError: if ``ground_truth`` is neither a letter A-J nor a valid index into ``extra_info["choices"]``.
    """
    score = 1.0 if extract_choice(solution_str) == truth_letter(ground_truth, extra_info) else 0.0
    return {"score": score, "acc": score}
