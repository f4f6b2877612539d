"""Evaluation of a real (tiny, random-init) HF model in one process: generate, score, report."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_ops.evaluation.evaluator import EvalData, EvalSettings, _score, evaluate_model
from tests.support.builders import write_toy_dataset


@pytest.fixture(scope="module")
def val_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    return str(write_toy_dataset("copy_digit", path, num_rows=12, seed=3, chat=False))


def test_report_is_consistent_with_its_examples(tiny_model_dir: str, val_file: str) -> None:
    data = EvalData(files=[val_file], max_prompt_length=16, apply_chat_template=False)
    settings = EvalSettings(max_prompts=8, n_samples=2, max_new_tokens=3, num_examples=8, batch_size=3)
    report = evaluate_model(tiny_model_dir, data, reward_fn="copy_digit", settings=settings)
    m, examples = report["metrics"], report["examples"]
    assert m["eval/num_prompts"] == 8.0 and len(examples) == 8  # batches of 3, 3, 2
    # every prompt's greedy example is in the report, so the metrics are their means
    assert m["eval/reward/mean"] == pytest.approx(sum(e["score"] for e in examples) / 8)
    assert m["eval/acc"] == pytest.approx(sum(e["correct"] for e in examples) / 8)
    assert m["eval/response_length/mean"] == pytest.approx(sum(e["length"] for e in examples) / 8)
    assert all(1 <= e["length"] <= 3 for e in examples)
    assert all(e["prompt"].startswith("copy: ") and e["ground_truth"] == e["prompt"][-1] for e in examples)
    # pass@1's unbiased estimate is the mean accuracy of a sample; pass@2 can only be higher
    assert m["eval/pass_at_1"] == pytest.approx(m["eval/mean_acc"])
    assert m["eval/pass_at_2"] >= m["eval/pass_at_1"]
    assert report["settings"]["n_samples"] == 2 and report["data_files"] == [val_file]
    # per-prompt rows (the paired promotion test reads them): their sample columns average to the sample metrics
    rows = report["per_prompt"]
    assert [r["index"] for r in rows] == list(range(8))
    assert m["eval/mean_acc"] == pytest.approx(sum(r["sample_acc"] for r in rows) / 8)
    assert m["eval/sample/reward/mean"] == pytest.approx(sum(r["sample_score"] for r in rows) / 8)
    assert report["eval_set"]["num_prompts"] == 8 and len(report["eval_set"]["sha256"]) == 64


def test_evaluation_is_deterministic(tiny_model_dir: str, val_file: str) -> None:
    data = EvalData(files=[val_file], max_prompt_length=16, apply_chat_template=False)
    settings = EvalSettings(max_prompts=4, n_samples=2, max_new_tokens=2, seed=7)
    first = evaluate_model(Path(tiny_model_dir), data, reward_fn="copy_digit", settings=settings)
    second = evaluate_model(Path(tiny_model_dir), data, reward_fn="copy_digit", settings=settings)
    assert first["metrics"] == second["metrics"] and first["examples"] == second["examples"]
    assert first["eval_set"] == second["eval_set"]  # same prompts, same fingerprint: the reports pair
    fewer = evaluate_model(Path(tiny_model_dir), data, reward_fn="copy_digit", settings=EvalSettings(max_prompts=3))
    assert fewer["eval_set"]["sha256"] != first["eval_set"]["sha256"]


def test_score_without_acc_uses_score_for_rows_with_ground_truth() -> None:
    def exact(data_source: str, solution: str, truth: str, extra: object) -> float:
        return 1.0 if solution == truth else 0.0

    assert _score(exact, data_source="s", response="7", truth="7") == (1.0, 1.0)
    assert _score(exact, data_source="s", response="8", truth="7") == (0.0, 0.0)
    assert _score(exact, data_source="s", response="8", truth="") == (0.0, None)  # no ground truth: no accuracy


def test_settings_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="ks=.* must lie in 1..n_samples=2"):
        EvalSettings(n_samples=2, ks=(4,))
    with pytest.raises(ValueError, match="max_prompts=0"):
        EvalSettings(max_prompts=0)
