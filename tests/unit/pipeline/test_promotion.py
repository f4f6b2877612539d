"""Promotion decisions: win, tie and loss on per-prompt scores, with intervals worked out by hand."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_ops.pipeline.promotion import PromotionSpec, choose_checkpoint, compare

N = 100


def report(correct: list[float], *, eval_set: str = "abc", score: list[float] | None = None) -> dict[str, Any]:
    scores = score if score is not None else correct
    return {
        "metrics": {"eval/acc": sum(correct) / len(correct), "eval/reward/mean": sum(scores) / len(scores)},
        "per_prompt": [
            {"index": i, "correct": c, "score": s} for i, (c, s) in enumerate(zip(correct, scores, strict=True))
        ],
        "eval_set": {"sha256": eval_set, "num_prompts": len(correct)},
    }


def right(k: int, *, start: int = 0) -> list[float]:
    """N prompts, prompts start..start+k-1 right."""
    return [1.0 if start <= i < start + k else 0.0 for i in range(N)]


WALD = PromotionSpec(method="wald")


def test_win_when_whole_interval_above_margin() -> None:
    # 30 prompts gained, none lost: gain 0.30; Wald se = sqrt(30 - 30^2/100) / 100 = sqrt(21)/100 = 0.04583,
    # z(97.5%) = 1.95996 -> [0.30 - 0.08982, 0.30 + 0.08982] = [0.2102, 0.3898], above the margin 0.
    d = compare(report(right(0)), report(right(30)), WALD, metric="eval/acc", names=("global_step_1", "global_step_2"))
    assert d.outcome == "win" and d.replaces
    assert d.gain is not None
    assert d.gain.gain == pytest.approx(0.30)
    assert d.gain.low == pytest.approx(0.2102, abs=1e-4) and d.gain.high == pytest.approx(0.3898, abs=1e-4)
    assert d.metrics("promotion/champion")["promotion/champion/n"] == 100.0
    assert "win (0.000 -> 0.300, gain +0.300, 95% CI [+0.210, +0.390], n=100, margin 0)" in d.summary()


def test_same_gain_is_a_tie_under_a_larger_margin() -> None:
    # The same interval [0.2102, 0.3898] with min_gain 0.25: its low end is below the margin.
    spec = PromotionSpec(method="wald", min_gain=0.25)
    d = compare(report(right(0)), report(right(30)), spec, metric="eval/acc", names=("a", "b"))
    assert d.outcome == "tie" and not d.replaces


def test_equal_scores_tie_and_keep_the_earlier_checkpoint() -> None:
    # The demo's case: both checkpoints 0.5 on every prompt; every difference is 0, so is the interval.
    flat = [0.5] * N
    reports = {50: report(right(60), score=flat), 100: report(right(60), score=flat)}
    best, walk = choose_checkpoint(reports, PromotionSpec(), metric="eval/reward/mean")
    assert best == 50
    assert [d.outcome for d in walk] == ["tie"]
    assert walk[0].gain is not None and (walk[0].gain.low, walk[0].gain.high) == (0.0, 0.0)


def test_small_gain_inside_noise_is_a_tie() -> None:
    # Step 100 gains prompts 60..64 (5) and loses 0..2 (3): gain +0.02, Wald se = sqrt(8 - 4/100)/100 = 0.02821,
    # interval [0.02 - 0.0553, 0.02 + 0.0553] = [-0.0353, 0.0753] straddles 0: tie, step 50 stays best.
    before = right(60)
    after = [0.0 if i < 3 else 1.0 if i < 65 else 0.0 for i in range(N)]
    d = compare(report(before), report(after), WALD, metric="eval/acc", names=("s50", "s100"))
    assert d.outcome == "tie"
    assert d.gain is not None and d.gain.low == pytest.approx(-0.0353, abs=1e-4)
    assert d.gain.high == pytest.approx(0.0753, abs=1e-4)


def test_loss_when_whole_interval_below_zero() -> None:
    # pass@4 0.617 -> 0.141 in the old demo is this shape: 30 prompts lost, none gained -> [-0.3898, -0.2102].
    d = compare(report(right(30)), report(right(0)), WALD, metric="eval/acc", names=("champion v1", "v2"))
    assert d.outcome == "loss" and not d.replaces
    assert d.gain is not None and d.gain.high == pytest.approx(-0.2102, abs=1e-4)


def test_bootstrap_interval_is_close_to_wald_and_deterministic() -> None:
    spec = PromotionSpec(resamples=4000, seed=3)
    a = compare(report(right(0)), report(right(30)), spec, metric="eval/acc", names=("a", "b"))
    b = compare(report(right(0)), report(right(30)), spec, metric="eval/acc", names=("a", "b"))
    assert a == b and a.outcome == "win"
    assert a.gain is not None and 0.19 < a.gain.low < 0.23 and 0.37 < a.gain.high < 0.41


def test_walk_moves_on_a_win_and_stays_on_a_tie() -> None:
    # step 1: 0 right; step 2: 30 right (win); step 3: the same 30 right (tie): step 2 is the best.
    reports = {3: report(right(30)), 1: report(right(0)), 2: report(right(30))}
    best, walk = choose_checkpoint(reports, WALD, metric="eval/acc")
    assert best == 2
    assert [(d.candidate, d.incumbent, d.outcome) for d in walk] == [
        ("global_step_2", "global_step_1", "win"),
        ("global_step_3", "global_step_2", "tie"),
    ]


def test_no_incumbent_replaces() -> None:
    d = compare(None, report(right(5)), PromotionSpec(), metric="eval/acc", names=(None, "v1"))
    assert d.outcome == "no_incumbent" and d.replaces and d.metrics("x") == {}


def test_different_eval_sets_are_refused() -> None:
    with pytest.raises(ValueError, match="evaluated on different eval sets"):
        compare(
            report(right(1), eval_set="aaa"),
            report(right(2), eval_set="bbb"),
            WALD,
            metric="eval/acc",
            names=("a", "b"),
        )


def test_metric_without_per_prompt_scores_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"metric\n  Input should be 'eval/acc', 'eval/mean_acc'"):
        PromotionSpec(metric="eval/pass_at_4")  # type: ignore[arg-type]  # refused as the form refuses it
    with pytest.raises(ValueError, match=r"^eval_metric='eval/x' has no per-prompt"):
        PromotionSpec().metric_name("eval/x")
    assert PromotionSpec().metric_name("eval/acc") == "eval/acc"


def test_old_report_without_per_prompt_rows_is_refused() -> None:
    old = {"metrics": {"eval/acc": 0.5}, "checkpoint": "/ckpt/global_step_2"}
    with pytest.raises(ValueError, match=r"/ckpt/global_step_2 has no per-prompt 'correct' scores"):
        compare(report(right(1)), old, WALD, metric="eval/acc", names=("a", "b"))


def test_promotion_metric_names_are_the_per_prompt_columns() -> None:
    from typing import get_args

    from rlhf_ops.pipeline.promotion import PER_PROMPT_COLUMNS, PromotionMetric

    assert sorted(get_args(PromotionMetric)) == sorted(PER_PROMPT_COLUMNS)
