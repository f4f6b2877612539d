"""builtin:gsm8k_synth: determinism, disjoint train / held-out sets, correct answers, verl layout end to end."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest

from rlhf_ops.data.dataset import PromptDataset
from rlhf_ops.data.gsm8k_synth import HELDOUT_SHARE, INSTRUCTION, MAX_ROWS, heldout_point, make_gsm8k_synth
from rlhf_ops.data.prepare_cli import prepare_from_args
from rlhf_ops.data.toy_tasks import make_toy_dataset
from rlhf_ops.rewards.default import default_compute_score
from rlhf_ops.rewards.gsm8k import gsm8k_score
from tests.support.builders import write_toy_dataset
from tests.support.real_model import smollm2_path

# One pattern per template, with the answer computed independently of the generator.
_SOLVERS: list[tuple[re.Pattern[str], Any]] = [
    (re.compile(r"has (\d+) \w+\. \w+ buys (\d+) more\. How many"), lambda a, b: a + b),
    (re.compile(r"has (\d+) \w+\. \w+ gives (\d+) of them to"), lambda a, b: a - b),
    (re.compile(r"buys (\d+) bags of \w+\. Each bag has (\d+) "), lambda a, b: a * b),
    (re.compile(r"has (\d+) \w+\. \w+ buys (\d+) more and then gives (\d+) to"), lambda a, b, c: a + b - c),
    (re.compile(r"has (\d+) \w+\. \w+ buys (\d+) boxes with (\d+) \w+ in each"), lambda c, a, b: c + a * b),
    (re.compile(r"had (\d+) \w+\. \w+ lost (\d+) on Monday and (\d+) on Tuesday"), lambda a, b, c: a - b - c),
]


def solve(question: str) -> int:
    [answer] = [fn(*map(int, m.groups())) for pattern, fn in _SOLVERS if (m := pattern.search(question))]
    return int(answer)


def test_first_rows_are_pinned_and_in_verls_layout() -> None:
    # Pinned: a change of the generator (or of Python's random) shows up here, not as a silent new dataset.
    [row] = make_gsm8k_synth("train", num_rows=1, seed=0)
    question = "Mia has 5 pencils. She buys 8 more. How many pencils does Mia have now?"
    assert row == {
        "prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
        "data_source": "synth/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "13"},  # 5 + 8
        "extra_info": {
            "split": "train",
            "index": 0,
            "question": question,
            "answer": "Mia has 5 + 8 = <<5+8=13>>13.\n#### 13",
            "num_ops": 1,
        },
    }
    assert "####" in INSTRUCTION
    [text_row] = make_gsm8k_synth("train", num_rows=1, seed=0, chat=False)
    assert text_row["prompt"] == f"{question}\n{INSTRUCTION}"


def test_deterministic_in_the_seed_and_distinct_within_a_set() -> None:
    assert make_gsm8k_synth("train", num_rows=50, seed=3) == make_gsm8k_synth("train", num_rows=50, seed=3)
    assert make_gsm8k_synth("train", num_rows=50, seed=3) != make_gsm8k_synth("train", num_rows=50, seed=4)
    rows = make_gsm8k_synth("test", num_rows=400, seed=0)
    assert len({r["extra_info"]["question"] for r in rows}) == 400
    assert [r["extra_info"]["index"] for r in rows] == list(range(400))


def test_train_and_heldout_are_disjoint_for_any_seeds() -> None:
    train = {r["extra_info"]["question"] for r in make_gsm8k_synth("train", num_rows=2000, seed=0)}
    for seed in (0, 1):
        test = {r["extra_info"]["question"] for r in make_gsm8k_synth("test", num_rows=400, seed=seed)}
        assert not train & test
        assert all(heldout_point(q) < HELDOUT_SHARE for q in test)
    assert all(heldout_point(q) >= HELDOUT_SHARE for q in train)


def test_answers_are_correct_and_the_gsm8k_reward_scores_the_reference_solution() -> None:
    rows = make_gsm8k_synth("train", num_rows=300, seed=1) + make_gsm8k_synth("test", num_rows=100, seed=1)
    ops = {1: 0, 2: 0}
    for row in rows:
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        assert truth == str(solve(info["question"])) and int(truth) >= 0
        for expr, value in re.findall(r"<<([^=]+)=(-?\d+)>>", info["answer"]):  # every calculator note is right
            assert eval(expr, {"__builtins__": {}}) == int(value)  # noqa: S307 (digits and + - * only)
        assert info["answer"].endswith(f"#### {truth}")
        assert gsm8k_score("synth/gsm8k", info["answer"], truth)["score"] == 1.0
        assert default_compute_score(row["data_source"], info["answer"], truth) == {"score": 1.0, "acc": 1.0}
        ops[info["num_ops"]] += 1
    assert 0.35 < ops[1] / len(rows) < 0.65  # half one-step, half two-step templates


def test_builtin_names_and_errors() -> None:
    assert make_toy_dataset("gsm8k_synth", num_rows=5, seed=2) == make_gsm8k_synth("train", num_rows=5, seed=2)
    assert make_toy_dataset("gsm8k_synth_test", num_rows=5, seed=2) == make_gsm8k_synth("test", num_rows=5, seed=2)
    with pytest.raises(ValueError, match="split='val' must be 'train' or 'test'"):
        make_gsm8k_synth("val", num_rows=1, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_rows=0 must be in 1..100000 \(data.toy_rows"):
        make_gsm8k_synth("train", num_rows=0, seed=0)
    with pytest.raises(ValueError, match="num_rows=100001 must be in 1..100000"):
        make_gsm8k_synth("test", num_rows=MAX_ROWS + 1, seed=0)


def test_parquet_file_and_prepare_data_in_verls_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    model = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(model)
    # The written file is verl's layout; the trainer's dataset reads the ground truth from reward_model.
    path = write_toy_dataset("gsm8k_synth_test", tmp_path / "test.parquet", num_rows=20, seed=0)
    frame = pd.read_parquet(path)
    assert list(frame.columns) == ["prompt", "data_source", "ability", "reward_model", "extra_info"]
    dataset = PromptDataset.from_sources([str(path)], tokenizer, max_prompt_length=256)
    rows = make_gsm8k_synth("test", num_rows=20, seed=0)
    assert dataset.ground_truths == [r["reward_model"]["ground_truth"] for r in rows]
    assert dataset.extra_infos == [r["extra_info"] for r in rows]
    builtin = PromptDataset.from_sources(["builtin:gsm8k_synth_test"], tokenizer, max_prompt_length=256, toy_rows=20)
    assert builtin.ground_truths == dataset.ground_truths and builtin.prompt_ids == dataset.prompt_ids

    args: dict[str, Any] = dict.fromkeys(
        ["val_source", "seed", "prompt_format", "system_prompt", "prompt_template", "max_rejected_fraction"]
    )
    args.update(source="builtin:gsm8k_synth", out=str(tmp_path / "out"), run_id="g", tokenizer=model, limit=64)
    args.update(max_prompt_length=256, val_fraction=0.0, field=[], no_chat_template=False, default_data_source=None)
    import argparse

    assert prepare_from_args(argparse.Namespace(**args)) == 0
    train = pq.read_table(f"{tmp_path}/out/g/train.parquet").to_pylist()
    expected = make_gsm8k_synth("train", num_rows=64, seed=0)
    assert len(train) == 64
    for got, want in zip(train, expected, strict=True):
        assert got["prompt"] == want["prompt"] and got["data_source"] == "synth/gsm8k" and got["ability"] == "math"
        assert got["reward_model"] == {"ground_truth": want["reward_model"]["ground_truth"], "style": "rule"}
        assert got["ground_truth"] == want["reward_model"]["ground_truth"]
        assert got["extra_info"].startswith('{"answer": ')  # JSON text with sorted keys
    assert capsys.readouterr().err == ""
