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


def _report(correct: list[int], files: list[str] | None = None) -> dict[str, object]:
    rows = [{"index": i, "score": float(c), "correct": float(c), "length": 3} for i, c in enumerate(correct)]
    return {"data_files": files or ["builtin:gsm8k_synth_test"], "per_prompt": rows}


def test_reports_compare_over_their_common_prompt_prefix() -> None:
    from rlhf_ops.evaluation.commands import paired_gain_of_reports

    # before on 4 prompts, after on 3: prompts 0-2 compared; 0 and 1 gained, none lost -> gain 2/3.
    res = paired_gain_of_reports(_report([0, 0, 1, 0]), _report([1, 1, 1]), confidence=0.95)
    assert res.n == 3 and res.gain == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="not over the same prompts"):
        paired_gain_of_reports(_report([0, 1]), _report([1, 1], files=["other.parquet"]), confidence=0.95)


def test_eval_gain_command_prints_one_line_per_result_and_refuses_bad_files(tmp_path, capsys) -> None:
    import json

    from rlhf_ops.cli import main

    before, after = tmp_path / "b.json", tmp_path / "a.json"
    before.write_text(json.dumps(_report([0, 0, 1, 1, 0])))
    after.write_text(json.dumps(_report([1, 1, 1, 0, 0])))
    assert main(["eval", "gain", str(before), str(after), "--out", str(tmp_path / "g.json")]) == 0
    out = capsys.readouterr().out
    assert "gain +20.0 pts" in out and "bootstrap check" in out
    assert json.loads((tmp_path / "g.json").read_text())["result"]["n"] == 5
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["eval", "gain", str(tmp_path / "bad.json"), str(after)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bad.json" in err[0]
