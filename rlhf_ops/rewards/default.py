"""Reward ``default``: one function for mixed datasets, dispatched on ``data_source`` (verl's
``default_compute_score``), and reward ``format``, the same dispatch for the answer format only.

=====================================================================  ===================
data_source                                                            reward
=====================================================================  ===================
``openai/gsm8k``, ``synth/gsm8k`` (``builtin:gsm8k_synth``)            ``gsm8k`` (strict)
``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,            ``math``
``HuggingFaceH4/MATH-500``, ``math``
``cais/mmlu``, ``allenai/ai2_arc``, ``multiple_choice``                ``multiple_choice``
``toy/copy_digit``, ``toy/add_digits``                                 the toy rewards
=====================================================================  ===================

``default`` returns ``{"score", "acc"}`` for every source: the reward stage needs the same keys on
every row, and a batch may mix sources.
"""

from __future__ import annotations

import re
from typing import Any

from rlhf_ops.data.toy_tasks import ADD_DIGITS_SOURCE, COPY_DIGIT_SOURCE, GSM8K_SYNTH_SOURCE
from rlhf_ops.extensions.rewards import reward_function
from rlhf_ops.rewards.gsm8k import extract_solution, gsm8k_score
from rlhf_ops.rewards.math_answer import last_boxed_only_string, math_score
from rlhf_ops.rewards.multiple_choice import extract_choice, multiple_choice_score
from rlhf_ops.rewards.toy import toy_compute_score

SOURCE_FAMILIES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    GSM8K_SYNTH_SOURCE: "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
    "cais/mmlu": "multiple_choice",
    "allenai/ai2_arc": "multiple_choice",
    "multiple_choice": "multiple_choice",
    COPY_DIGIT_SOURCE: "toy",
    ADD_DIGITS_SOURCE: "toy",
}
"""data_source -> reward family; extend a copy in your own dispatcher for other sources."""

_SCORERS = {
    "gsm8k": gsm8k_score,
    "math": math_score,
    "multiple_choice": multiple_choice_score,
    "toy": toy_compute_score,
}
_THINK_ANSWER = re.compile(r"\s*<think>.+?</think>\s*<answer>.+?</answer>\s*", re.DOTALL)


def _family(data_source: str, *, reward: str) -> str:
    family = SOURCE_FAMILIES.get(data_source)
    if family is None:
        raise ValueError(
            f"reward {reward}: data_source={data_source!r} has no built-in reward (known: {sorted(SOURCE_FAMILIES)}); "
            "set data_source in the data, or reward.reward_fn to gsm8k / math / multiple_choice or your own."
        )
    return family


@reward_function("default", description="Dispatch on data_source.")
def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward ``default``: the built-in reward of ``data_source`` (table in the module docstring).

    Returns:
        ``{"score", "acc"}``.

    Raises:
        ValueError: if ``data_source`` is not in :data:`SOURCE_FAMILIES`.
    """
    result = _SCORERS[_family(data_source, reward="default")](data_source, solution_str, ground_truth, extra_info)
    return {"score": float(result["score"]), "acc": float(result["acc"])}


def has_answer_format(family: str, solution_str: str) -> bool:
    """Whether a response states its answer the way ``family`` expects (not whether it is right).

    ``gsm8k``: a ``#### N`` answer; ``math``: a complete ``\\boxed{}``; ``multiple_choice``: a choice
    letter; ``think_answer``: exactly ``<think>...</think><answer>...</answer>`` (R1-style).
    """
    if family == "gsm8k":
        return extract_solution(solution_str, "strict") is not None
    if family == "math":
        return last_boxed_only_string(solution_str) is not None
    if family == "multiple_choice":
        return extract_choice(solution_str) is not None
    if family == "think_answer":
        return _THINK_ANSWER.fullmatch(solution_str) is not None
    raise ValueError(f"format: family={family!r} must be one of gsm8k, math, multiple_choice, think_answer")


@reward_function("format", description="Answer format only.")
def format_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> dict[str, float]:
    """Reward ``format``: 1.0 iff the response has its source's answer format (ground truth unused).

    The format is ``extra_info["format"]`` when set (``gsm8k``, ``math``, ``multiple_choice``,
    ``think_answer``), else the data source's family (table above), else ``think_answer``.

    Returns:
        ``{"score", "acc"}``, equal (``acc``: the format is right).
    """
    family = (extra_info or {}).get("format") or SOURCE_FAMILIES.get(data_source, "think_answer")
    if family == "toy":
        family = "think_answer"
    score = 1.0 if has_answer_format(str(family), solution_str) else 0.0
    return {"score": score, "acc": score}
