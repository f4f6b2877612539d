"""The built-in rule rewards on hand-written responses: gsm8k, math, multiple choice, format, dispatch."""

from __future__ import annotations

import threading

import pytest

from rlhf_ops.rewards import BUILTIN_REWARD_FNS
from rlhf_ops.rewards.default import SOURCE_FAMILIES, default_compute_score, format_score
from rlhf_ops.rewards.gsm8k import compute_score, extract_solution, gsm8k_flexible_score, gsm8k_score
from rlhf_ops.rewards.math_answer import is_equiv, last_boxed_only_string, math_score, normalize_answer, remove_boxed
from rlhf_ops.rewards.multiple_choice import extract_choice, multiple_choice_score

# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    ("response", "strict", "flexible"),
    [
        ("She has 5 + 7 = 12 apples.\n#### 12", "12", "12"),
        ("So the total is 1,234 dollars. #### 1,234", "1234", "1234"),  # commas removed
        ("It drops by 5 degrees. #### -5", "-5", "-5"),  # negative
        ("#### $18", "18", "18"),  # dollar sign
        ("The answer is 12.", None, "12"),  # no marker: strict finds nothing, trailing "." dropped
        ("#### 3 and then #### 4", "4", "4"),  # the last one
        ("I think 7, no wait, 9", None, "9"),
        ("#### .", None, None),  # a marker without a number, and no digit anywhere
        ("no numbers at all", None, None),
        ("12 apples " + "x" * 400, None, None),  # only the last 300 characters are searched
    ],
)
def test_gsm8k_extraction(response: str, strict: str | None, flexible: str | None) -> None:
    assert extract_solution(response, "strict") == strict
    assert extract_solution(response, "flexible") == flexible


def test_gsm8k_scores_strict_vs_flexible() -> None:
    # The right number without "####": strict 0, flexible 1 (both logged by both rewards).
    unmarked = "Tom has 7 + 5 = 12 apples."
    assert gsm8k_score("openai/gsm8k", unmarked, "12") == {
        "score": 0.0, "acc": 0.0, "acc_strict": 0.0, "acc_flexible": 1.0
    }  # fmt: skip
    assert gsm8k_flexible_score("openai/gsm8k", unmarked, "12")["score"] == 1.0
    # Numbers compare as numbers: "12.0" and "1,000" match "12" and "1000".
    assert gsm8k_score("openai/gsm8k", "#### 12.0", "12")["score"] == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 1,000", "1000")["score"] == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 1,000", "1,000")["score"] == 1.0
    assert gsm8k_score("openai/gsm8k", "#### -3", "3")["score"] == 0.0  # the sign matters
    assert gsm8k_score("openai/gsm8k", "#### 13", "12")["score"] == 0.0
    # The last marker wins, an earlier right one does not count.
    assert gsm8k_score("openai/gsm8k", "#### 12\n#### 13", "12")["score"] == 0.0


def test_gsm8k_compute_score_keeps_verls_format_score() -> None:
    assert compute_score("#### 13", "12", format_score=0.1) == 0.1  # an answer, wrong: format credit
    assert compute_score("13", "12", format_score=0.1) == 0.0  # no answer at all
    assert compute_score("#### 12", "12", score=2.0) == 2.0
    with pytest.raises(ValueError, match="method='loose' must be 'strict' or 'flexible'"):
        extract_solution("1", "loose")  # type: ignore[arg-type]


# ---------------------------------------------------------------- math


def test_boxed_extraction() -> None:
    assert last_boxed_only_string(r"so $\boxed{\frac{1}{2}}$.") == r"\boxed{\frac{1}{2}}"
    assert last_boxed_only_string(r"\boxed{1} then \boxed{2}") == r"\boxed{2}"
    assert last_boxed_only_string(r"\boxed 5$ done") == r"\boxed 5"
    assert last_boxed_only_string(r"\fbox{x}") == r"\fbox{x}"
    assert last_boxed_only_string(r"cut off \boxed{\frac{1}{2") is None  # unbalanced
    assert last_boxed_only_string("no box") is None
    assert remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert remove_boxed(r"\boxed 5") == "5"


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        ("x = 5", "5"),
        (r"10\%", "10"),
        (r"90^\circ", "90"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"5 \text{ cm}", "5"),
        ("3/4", r"\frac{3}{4}"),
        (r"\sqrt3", r"\sqrt{3}"),
        (".5", r"\frac{1}{2}"),
    ],
)
def test_normalize_answer(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),  # fraction vs decimal
        (r"$\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"$\boxed{0.25}$", r"\frac{1}{4}", 1.0),  # exact fraction arithmetic, not the 0.5 special case
        (r"$\boxed{-\frac{3}{4}}$", "-0.75", 1.0),
        (r"$\boxed{\dfrac{2}{4}}$", r"\frac{1}{2}", 1.0),
        (r"$\boxed{2\sqrt{2}}$", r"\sqrt{8}", 1.0),  # symbolic: math-verify
        (r"$\boxed{\frac{1}{3}}$", "0.5", 0.0),
        (r"$\boxed{3}$", r"\boxed{3}", 1.0),  # a ground truth that is itself boxed
        (r"the answer is 0.5", "0.5", 0.0),  # no box, no credit
        (r"$\boxed{x^2+1}$", "1+x^2", 1.0),
    ],
)
def test_math_score(response: str, truth: str, score: float) -> None:
    assert math_score("lighteval/MATH", response, truth) == {"score": score, "acc": score}


def test_math_verify_off_the_main_thread() -> None:
    # signal.alarm only works on the main thread: a worker thread must still get an answer.
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(is_equiv(r"2\sqrt{2}", r"\sqrt{8}")))
    thread.start()
    thread.join()
    assert results == [True]


# ---------------------------------------------------------------- multiple choice


@pytest.mark.parametrize(
    ("response", "choice"),
    [
        ("B", "B"),
        ("B.", "B"),
        ("(C) Paris", "C"),
        ("D) 42", "D"),
        ("The answer is (A).", "A"),
        ("Answer: **C**", "C"),
        ("I first thought A, but the answer is D", "D"),
        (r"so $\boxed{B}$", "B"),
        ("A good guess is C", None),  # letters in prose are no choice
        ("the answer is a dog", None),  # a lower-case word is not option A
        ("Answer: Carbon", None),
        ("", None),
    ],
)
def test_extract_choice(response: str, choice: str | None) -> None:
    assert extract_choice(response) == choice


def test_multiple_choice_score_letters_and_indices() -> None:
    assert multiple_choice_score("cais/mmlu", "The answer is (B)", "B")["score"] == 1.0
    assert multiple_choice_score("cais/mmlu", "The answer is (B)", "(b)")["score"] == 1.0
    assert multiple_choice_score("cais/mmlu", "The answer is (B)", "C")["score"] == 0.0
    choices = {"choices": ["red", "green", "blue"]}
    assert multiple_choice_score("cais/mmlu", "Answer: B", "1", choices)["score"] == 1.0  # index 1 = B
    with pytest.raises(ValueError, match="ground_truth='5' is no index into the 3"):
        multiple_choice_score("cais/mmlu", "B", "5", choices)
    with pytest.raises(ValueError, match="ground_truth='Paris' is not an option letter A-J"):
        multiple_choice_score("cais/mmlu", "B", "Paris")


# ---------------------------------------------------------------- dispatch and format


@pytest.mark.parametrize(
    ("source", "response", "truth"),
    [
        ("openai/gsm8k", "#### 12", "12"),
        ("synth/gsm8k", "#### 12", "12"),
        ("lighteval/MATH", r"\boxed{\frac{1}{2}}", "0.5"),
        ("DigitalLearningGmbH/MATH-lighteval", r"\boxed{3}", "3"),
        ("cais/mmlu", "Answer: A", "A"),
        ("toy/copy_digit", "7", "7"),
    ],
)
def test_default_dispatches_on_data_source(source: str, response: str, truth: str) -> None:
    assert default_compute_score(source, response, truth) == {"score": 1.0, "acc": 1.0}
    assert BUILTIN_REWARD_FNS["default"] is default_compute_score


def test_default_keys_are_the_same_for_every_source() -> None:
    # gsm8k's own result has four keys; dispatch keeps score/acc so a mixed batch has one key set.
    assert set(default_compute_score("openai/gsm8k", "12", "12")) == {"score", "acc"}
    assert default_compute_score("openai/gsm8k", "12", "12")["score"] == 0.0  # strict: no "####"


def test_default_refuses_an_unknown_source_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"data_source='my/data' has no built-in reward .* set data_source"):
        default_compute_score("my/data", "1", "1")
    assert "openai/gsm8k" in SOURCE_FAMILIES


@pytest.mark.parametrize(
    ("source", "response", "extra_info", "score"),
    [
        ("openai/gsm8k", "blah #### 99", None, 1.0),  # wrong answer, right format
        ("openai/gsm8k", "99", None, 0.0),
        ("lighteval/MATH", r"\boxed{7}", None, 1.0),
        ("lighteval/MATH", r"\boxed{7", None, 0.0),
        ("cais/mmlu", "Answer: E", None, 1.0),
        ("my/data", "<think>hmm</think> <answer>4</answer>", None, 1.0),  # unknown source: R1 format
        ("my/data", "<answer>4</answer>", None, 0.0),
        ("my/data", "#### 4", {"format": "gsm8k"}, 1.0),  # extra_info picks the format
    ],
)
def test_format_score(source: str, response: str, extra_info: dict[str, str] | None, score: float) -> None:
    assert format_score(source, response, "1", extra_info) == {"score": score, "acc": score}
