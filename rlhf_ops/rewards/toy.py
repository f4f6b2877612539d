"""Rule-based rewards of the built-in toy tasks (:mod:`rlhf_ops.data.toy_tasks`).

Both tasks share one shaped score, on the decoded response ``solution_str`` (special tokens skipped,
so a response ``"7<eos>"`` decodes to ``"7"``; no leading whitespace is allowed):

============================================================  =====
response                                                      score
============================================================  =====
exactly the ground truth (answered, then stopped)             1.0
starts with the ground truth, more characters follow          0.5
anything else (a wrong digit, empty, a non-digit)             0.0
============================================================  =====

Why no credit for a wrong digit: an earlier version gave 0.1 for "starts with a digit". GRPO then
collapsed onto one fixed digit (every sample of a group scoring 0.1 leaves no advantage), and copy
accuracy never rose above chance. With credit only for the right answer, the tiny model (with the
digit as the prompt's last token, ``data.apply_chat_template=false`` in the tiny-cpu preset) copies
the digit in >80% of samples after ~60 steps (measured: 0.016 -> 0.84, see tests/e2e).
The 0.5 step rewards the prompt-dependent answer, the 1.0 step stopping right after it.

``acc`` is the unshaped metric for accuracy and pass@k: 1.0 iff the run of digits the response starts
with equals the ground truth (``"7"`` and ``"7."`` are right for ``"7"``, ``"77"`` is not).
"""

from __future__ import annotations

import re
from typing import Any

from rlhf_ops.data.toy_tasks import ADD_DIGITS_SOURCE, COPY_DIGIT_SOURCE
from rlhf_ops.extensions.rewards import reward_function

# rlhf_ops.data.images' data source, repeated here: importing that module pulls torch into the Airflow side.
COLOR_NAME_SOURCE = "toy/color_name"

_LEADING_NUMBER = re.compile(r"\d+")


def shaped_answer_score(solution_str: str, ground_truth: str) -> dict[str, float]:
    """Returns ``{"score": shaped score, "acc": 1.0 or 0.0}`` per the table in the module docstring."""
    match = _LEADING_NUMBER.match(solution_str)
    acc = 1.0 if match is not None and match.group() == ground_truth else 0.0
    if solution_str == ground_truth:
        score = 1.0
    elif ground_truth and solution_str.startswith(ground_truth):
        score = 0.5
    else:
        score = 0.0
    return {"score": score, "acc": acc}


@reward_function("copy_digit", description="Toy: copy a digit.")
def copy_digit_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward of ``copy_digit`` (``"copy: 7"`` → ``"7"``); see the module docstring."""
    return shaped_answer_score(solution_str, ground_truth)


@reward_function("add_digits", description="Toy: add two digits.")
def add_digits_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward of ``add_digits`` (``"2+5="`` → ``"7"``); see the module docstring."""
    return shaped_answer_score(solution_str, ground_truth)


@reward_function("color_name", description="Toy: name a colour.")
def color_name_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward of ``color_name`` (a solid-colour image → its colour word, e.g. ``"red"``).

    1.0 for exactly the word; 0.5 x (characters of the word the response starts with) / (word length)
    otherwise, so ``"r"`` scores 1/6 and ``"redx"`` 0.5 for ``"red"``. Every credited character is the
    image's own word: a policy that ignores the image cannot collect it for more than one colour. ``acc``
    (the response starts with the word) and ``initial_acc`` (its first letter is the word's) are unshaped.
    """
    prefix = 0
    for got, want in zip(solution_str, ground_truth, strict=False):
        if got != want:
            break
        prefix += 1
    score = 1.0 if solution_str == ground_truth else 0.5 * prefix / max(len(ground_truth), 1)
    acc = float(bool(ground_truth) and solution_str.startswith(ground_truth))
    return {"score": score, "acc": acc, "initial_acc": float(prefix > 0)}


_BY_SOURCE = {
    COPY_DIGIT_SOURCE: copy_digit_score,
    ADD_DIGITS_SOURCE: add_digits_score,
    COLOR_NAME_SOURCE: color_name_score,
}


@reward_function("toy", description="The toy tasks, by source.")
def toy_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Dispatches on ``data_source`` to the toy task's reward (verl's ``default_compute_score`` pattern).

    Raises:
        ValueError: if ``data_source`` is not a toy task's.
    """
    fn = _BY_SOURCE.get(data_source)
    if fn is None:
        raise ValueError(
            f"data_source={data_source!r} has no toy reward (known: {sorted(_BY_SOURCE)}); "
            "set the reward function to one that scores this data source."
        )
    return fn(data_source, solution_str, ground_truth, extra_info)
