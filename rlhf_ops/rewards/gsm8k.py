"""GSM8K reward: the final number after ``####`` (verl's ``gsm8k.compute_score`` semantics).

Extraction works on the last 300 characters of the response (as verl does: long reasoning that mentions
many numbers must not leak an early one into the answer):

* ``strict``: the last ``#### <number>`` (``#### 1,234`` and ``#### -5`` are numbers; the answer format
  GSM8K's reference solutions end with). A response without the marker has no answer.
* ``flexible``: the last number anywhere in the response (``"... so she has 12 apples."`` -> ``12``).

Numbers are compared as numbers after removing ``,`` and ``$`` (``"1,234"`` == ``"1234"``, ``"12.0"``
== ``"12"``, ``"12."`` == ``"12"``), where verl compares strings; a string match is still required when
a side is not a number.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from rlhf_ops.extensions.rewards import reward_function

Method = Literal["strict", "flexible"]
CLIP_CHARS = 300  # only the response's tail is searched, like verl's _SOLUTION_CLIP_CHARS
_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9][0-9.,]*|-?\.[0-9]+")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(solution_str: str, method: Method = "strict") -> str | None:
    """The answer of a response, commas and ``$`` removed, or None when there is none.

    Args:
        solution_str: The decoded response.
        method: ``"strict"`` (the last ``#### N``) or ``"flexible"`` (the last number anywhere).

    Returns:
        e.g. ``"1234"`` for ``"... #### 1,234"``; None when nothing matches.

    Raises:
        ValueError: on another ``method``.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method={method!r} must be 'strict' or 'flexible'")
    tail = solution_str[-CLIP_CHARS:]
    found = _STRICT.findall(tail) if method == "strict" else _ANY_NUMBER.findall(tail)
    for candidate in reversed(found):  # "#### ." or "#### ," is no number: take an earlier one
        cleaned = _clean(candidate)
        if cleaned not in ("", "-") and any(c.isdigit() for c in cleaned):
            return cleaned
    return None


def answers_match(answer: str, ground_truth: str) -> bool:
    """Numeric equality when both parse as decimals (``"12.0"`` == ``"12"``), else string equality."""
    truth = _clean(ground_truth.strip())
    try:
        return Decimal(answer) == Decimal(truth)
    except InvalidOperation:
        return answer == truth


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's ``gsm8k.compute_score``: ``score`` if right, ``format_score`` if an answer was found, else 0."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answers_match(answer, ground_truth) else format_score


def _result(solution_str: str, ground_truth: str, method: Method) -> dict[str, float]:
    strict = compute_score(solution_str, ground_truth, "strict")
    flexible = compute_score(solution_str, ground_truth, "flexible")
    main = strict if method == "strict" else flexible
    # acc: the reward's own criterion; the other extraction is logged too (how far strict format lags).
    return {"score": main, "acc": main, "acc_strict": strict, "acc_flexible": flexible}


@reward_function("gsm8k", description="GSM8K, strict '#### N'.")
def gsm8k_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward ``gsm8k``: 1.0 iff the strict ``#### N`` answer equals ``ground_truth`` (verl's default).

    Returns:
        ``{"score", "acc", "acc_strict", "acc_flexible"}`` (``score == acc == acc_strict``).
    """
    return _result(solution_str, ground_truth, "strict")


@reward_function("gsm8k_flexible", description="GSM8K, last number.")
def gsm8k_flexible_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward ``gsm8k_flexible``: 1.0 iff the last number of the response equals ``ground_truth``.

    Returns:
        ``{"score", "acc", "acc_strict", "acc_flexible"}`` (``score == acc == acc_flexible``).
    """
    return _result(solution_str, ground_truth, "flexible")
