"""Evaluation metrics with hand-derived values."""

from __future__ import annotations

import math

import pytest

from rlhf_ops.evaluation.metrics import ScoredResponse, default_ks, greedy_metrics, pass_at_k, sample_metrics


def _row(i: int, score: float, correct: float | None, *, source: str = "toy/a", length: int = 3) -> ScoredResponse:
    return ScoredResponse(
        prompt_index=i, data_source=source, response="x", length=length, score=score, correct=correct
    )


def test_pass_at_k_matches_the_combinatorial_formula() -> None:
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k=1 is the fraction correct: c/n = 1/4
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n-c < k: every draw of k holds a correct sample
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_default_ks_are_powers_of_two_then_n() -> None:
    assert default_ks(0) == []
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]


def test_greedy_metrics_mean_reward_accuracy_lengths_and_per_source() -> None:
    rows = [
        _row(0, 1.0, 1.0, length=2),
        _row(1, 0.5, 0.0, length=4),
        _row(2, 0.0, 0.0, source="toy/b", length=6),
        _row(3, 0.1, None, source="toy/b", length=1),  # no ground truth: not in accuracy
    ]
    m = greedy_metrics(rows)
    assert m["eval/reward/mean"] == pytest.approx((1.0 + 0.5 + 0.0 + 0.1) / 4)  # 0.4
    assert m["eval/acc"] == pytest.approx(1 / 3)  # three checked rows, one right
    assert m["eval/response_length/mean"] == pytest.approx(13 / 4)
    assert (m["eval/response_length/max"], m["eval/response_length/min"]) == (6.0, 1.0)
    assert m["eval/toy/a/acc"] == pytest.approx(0.5)
    assert m["eval/toy/b/reward/mean"] == pytest.approx(0.05)
    assert m["eval/toy/b/acc"] == 0.0
    assert m["eval/num_prompts"] == 4.0


def test_sample_metrics_pass_at_k_averages_over_prompts() -> None:
    # prompt 0: 1 of 4 right -> pass@1 = 0.25, pass@2 = 0.5, pass@4 = 1
    # prompt 1: 0 of 4 right -> 0, 0, 0
    rows = [_row(0, 1.0, 1.0)] + [_row(0, 0.0, 0.0)] * 3 + [_row(1, 0.0, 0.0)] * 4
    m = sample_metrics(rows, n=4, ks=[1, 2, 4])
    assert m["eval/pass_at_1"] == pytest.approx(0.125)
    assert m["eval/pass_at_2"] == pytest.approx(0.25)
    assert m["eval/pass_at_4"] == pytest.approx(0.5)
    assert m["eval/mean_acc"] == pytest.approx(1 / 8)
    assert m["eval/sample/reward/mean"] == pytest.approx(1 / 8)


def test_sample_metrics_requires_n_per_prompt() -> None:
    with pytest.raises(ValueError, match="n=4"):
        sample_metrics([_row(0, 1.0, 1.0)] * 3, n=4, ks=[1])


def test_empty_greedy_rows_give_nan_mean() -> None:
    assert math.isnan(greedy_metrics([])["eval/reward/mean"])
