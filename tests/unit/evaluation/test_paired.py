"""Paired gain intervals: hand-derived values."""

from __future__ import annotations

import math

import pytest

from rlhf_ops.evaluation.paired import paired_bootstrap, paired_proportion_interval


def test_paired_proportions_match_the_hand_computation() -> None:
    # Prompts 0 and 1 flip to right, prompt 3 flips to wrong: b=2, c=1, n=5, gain (2-1)/5 = 0.2.
    # Variance numerator (b+c) - (b-c)^2/n = 3 - 1/5 = 2.8, so se = sqrt(2.8)/5 = 0.334664.
    res = paired_proportion_interval([0, 0, 1, 1, 0], [1, 1, 1, 0, 0])
    assert res.gain == pytest.approx(0.2)
    assert (res.before, res.after) == (pytest.approx(0.4), pytest.approx(0.6))
    half = 1.959964 * math.sqrt(2.8) / 5
    assert res.low == pytest.approx(0.2 - half, abs=1e-6) and res.high == pytest.approx(0.2 + half, abs=1e-6)


def test_no_change_gives_a_zero_width_interval() -> None:
    res = paired_proportion_interval([1, 0, 1], [1, 0, 1])
    assert (res.gain, res.low, res.high) == (0.0, 0.0, 0.0)


def test_bootstrap_of_constant_differences_is_that_constant() -> None:
    res = paired_bootstrap([0.2] * 30, [0.3] * 30, resamples=500)
    assert res.low == pytest.approx(0.1) and res.high == pytest.approx(0.1) and res.gain == pytest.approx(0.1)


def test_bootstrap_agrees_with_the_normal_approximation_on_a_large_sample() -> None:
    # 100 prompts, 50 gained and 50 unchanged: gain 0.5, sd of a diff 0.5, se 0.05 -> 95% CI ~ [0.402, 0.598].
    before, after = [0.0] * 100, [1.0] * 50 + [0.0] * 50
    res = paired_bootstrap(before, after, resamples=4000, seed=3)
    assert res.gain == pytest.approx(0.5)
    assert res.low == pytest.approx(0.402, abs=0.02) and res.high == pytest.approx(0.598, abs=0.02)
    assert paired_bootstrap(before, after, resamples=4000, seed=3) == res  # deterministic
    assert "gain +50.0 pts" in res.summary()


@pytest.mark.parametrize(
    ("before", "after", "kwargs", "match"),
    [
        ([1, 0], [1], {}, "equal lengths"),
        ([], [], {}, "empty"),
        ([1], [0], {"confidence": 1.0}, "strictly between"),
    ],
)
def test_bad_input_is_refused(before: list[float], after: list[float], kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(before, after, **kwargs)
    with pytest.raises(ValueError, match=match):
        paired_proportion_interval(before, after, **kwargs)


def test_graded_scores_need_the_bootstrap() -> None:
    with pytest.raises(ValueError, match="0/1 scores"):
        paired_proportion_interval([0.5], [1.0])
