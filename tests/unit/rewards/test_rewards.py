"""Toy reward shaping, reward-function lookup by name / dotted path, token-level placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.rewards import BUILTIN_REWARD_FNS, RewardFn, compute_token_level_scores, load_reward_fn
from rlhf_ops.rewards.toy import add_digits_score, copy_digit_score, toy_compute_score


@pytest.mark.parametrize(
    ("solution", "truth", "score", "acc"),
    [
        ("7", "7", 1.0, 1.0),  # answered, then EOS
        ("7.", "7", 0.5, 1.0),  # right answer, more characters
        ("77", "7", 0.5, 0.0),  # starts with the answer, but the number read is 77
        ("3", "7", 0.0, 0.0),  # a digit, wrong: no credit
        ("37", "7", 0.0, 0.0),
        (" 7", "7", 0.0, 0.0),  # leading whitespace is not an answer
        ("x7", "7", 0.0, 0.0),
        ("", "7", 0.0, 0.0),
        ("12", "12", 1.0, 1.0),  # two-digit sums
        ("1", "12", 0.0, 0.0),
        ("12+", "12", 0.5, 1.0),
    ],
)
def test_shaped_score_table(solution: str, truth: str, score: float, acc: float) -> None:
    assert copy_digit_score("toy/copy_digit", solution, truth, None) == {"score": score, "acc": acc}
    assert add_digits_score("toy/add_digits", solution, truth) == {"score": score, "acc": acc}


def test_toy_dispatches_on_data_source() -> None:
    assert toy_compute_score("toy/add_digits", "9", "9", None)["score"] == 1.0
    with pytest.raises(ValueError, match="data_source='gsm8k' has no toy reward"):
        toy_compute_score("gsm8k", "9", "9", None)


def test_builtins_and_dotted_paths_resolve() -> None:
    assert load_reward_fn("toy") is toy_compute_score
    assert set(BUILTIN_REWARD_FNS) == {
        "default", "gsm8k", "gsm8k_flexible", "math", "multiple_choice", "format", "toy", "copy_digit", "add_digits",
        "color_name",
    }  # fmt: skip
    assert load_reward_fn("rlhf_ops.rewards.toy:copy_digit_score") is copy_digit_score
    assert load_reward_fn("rlhf_ops.rewards.toy.add_digits_score") is add_digits_score
    assert isinstance(load_reward_fn("toy"), RewardFn)


def test_user_module_by_dotted_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "class Scorers:\n"
        "    @staticmethod\n"
        "    def length(data_source, solution_str, ground_truth, extra_info=None):\n"
        "        return float(len(solution_str))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("my_rewards:Scorers.length")
    assert fn("d", "abc", "", None) == 3.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nosuchname", "neither a built-in .* nor a dotted path"),
        ("no_such_pkg.rewards:score", "cannot import module 'no_such_pkg.rewards'.*PYTHONPATH"),
        ("rlhf_ops.rewards.toy:missing", "has no attribute 'missing'"),
        ("rlhf_ops.data.toy_tasks:COPY_DIGIT_SOURCE", "resolves to a str, which is not callable"),
        (":score", "neither a built-in"),
    ],
)
def test_bad_specs_raise_value_errors_naming_the_spec(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_reward_fn(spec)
    assert repr(spec) in str(info.value)


def test_scores_sit_on_the_last_valid_token() -> None:
    responses = torch.zeros(3, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    scores, extra = compute_token_level_scores(
        responses,
        mask,
        decoded=["7", "3abc", "5"],
        data_sources=["toy/copy_digit"] * 3,
        ground_truths=["7", "7", "5"],
        reward_fn=toy_compute_score,
    )
    # row 0: 2 valid tokens, exact → 1.0 at column 1; row 1: wrong digit → 0.0; row 2: exact at 0
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(scores, expected)
    assert extra == {"acc": [1.0, 0.0, 1.0], "score": [1.0, 0.0, 1.0]}


def test_scores_sit_on_the_last_model_token_of_a_multi_turn_mask() -> None:
    # Row 0: model, model, tool, tool, model (EOS), pad -> column 4 (mask.sum() - 1 would say column 2).
    # Row 1: the last turn is a tool output (max_turns hit) -> the last model token, column 1.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
    scores, _ = compute_token_level_scores(
        torch.zeros(2, 6, dtype=torch.long),
        mask,
        decoded=["7", "7"],
        data_sources=["toy/copy_digit"] * 2,
        ground_truths=["7", "7"],
        reward_fn=toy_compute_score,
    )
    torch.testing.assert_close(scores, torch.tensor([[0.0, 0, 0, 0, 1, 0], [0.0, 1, 0, 0, 0, 0]]))


def test_float_results_give_no_extras_and_empty_rows_use_column_zero() -> None:
    def constant(data_source: str, solution_str: str, ground_truth: str, extra_info: Any) -> float:
        return 2.5 if extra_info is None else extra_info["value"]

    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    scores, extra = compute_token_level_scores(
        torch.zeros(2, 3, dtype=torch.long),
        mask,
        decoded=["", "ab"],
        data_sources=["d", "d"],
        ground_truths=["", ""],
        reward_fn=constant,
        extra_infos=[None, {"value": -1.0}],
    )
    torch.testing.assert_close(scores, torch.tensor([[2.5, 0.0, 0.0], [0.0, -1.0, 0.0]]))
    assert extra == {}


def test_bad_reward_results_and_lengths_raise() -> None:
    responses, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    kwargs: dict[str, Any] = {"decoded": ["a"], "data_sources": ["d"], "ground_truths": ["g"]}
    with pytest.raises(ValueError, match="without 'score'"):
        compute_token_level_scores(responses, mask, reward_fn=lambda *a: {"acc": 1.0}, **kwargs)
    with pytest.raises(ValueError, match="returned score='high'"):
        compute_token_level_scores(responses, mask, reward_fn=lambda *a: "high", **kwargs)
    with pytest.raises(ValueError, match="decoded has 2 entries but responses have B=1"):
        compute_token_level_scores(responses, mask, reward_fn=toy_compute_score, **{**kwargs, "decoded": ["a", "b"]})
    keys = iter([{"score": 1.0}, {"score": 1.0, "acc": 1.0}])
    with pytest.raises(ValueError, match="different keys"):
        compute_token_level_scores(
            torch.zeros(2, 2),
            torch.ones(2, 2),
            reward_fn=lambda *a: next(keys),
            **{k: v * 2 for k, v in kwargs.items()},
        )
