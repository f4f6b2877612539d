"""field_map transforms: raw GSM8K / MATH rows become prompts and ground truths the rewards score right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import ValidationError

from rlhf_ops.data.field_transforms import GSM8K_INSTRUCTION, parse_field_source
from rlhf_ops.data.prepare import PrepareSpec, prepare_dataset
from rlhf_ops.data.prepare_cli import prepare_from_args
from rlhf_ops.models.resolve import resolve_model_path
from rlhf_ops.pipeline.params import PipelineParams
from rlhf_ops.rewards import load_reward_fn

GSM8K_SPEC = Path(__file__).parents[3] / "dags" / "specs" / "qwen2_5_0_5b_grpo_gpu_daily.yaml"
# Rows as GSM8K's train split holds them: a question, and a worked answer with calculator annotations that ends
# with "#### <number>" (thousands written with a comma in some answers).
GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A shop sells 1,000 pens a day for 3 days and 234 on the fourth. How many pens in all?",
        "answer": "It sells 1,000*3 = <<1000*3=3000>>3,000 in three days.\n3,000+234 = <<3000+234=3234>>3,234\n"
        "#### 3,234",
    },
    {"question": "How many legs do 3 cats have?", "answer": "Each cat has 4 legs, so 3*4 = <<3*4=12>>12 legs."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-llama"))


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_shipped_gsm8k_spec_prepares_ground_truths_the_gsm8k_reward_scores(tmp_path: Path, tokenizer: Any) -> None:
    field_map = yaml.safe_load(GSM8K_SPEC.read_text())["data"]["field_map"]
    params = PipelineParams(field_map=field_map)  # the trigger form's check of the spec's map
    spec = PrepareSpec(
        source=_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS),
        field_map=dict(params.field_map),
        max_prompt_length=512,
        val_fraction=0.0,
        max_rejected_fraction=0.5,
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r", tokenizer=tokenizer)
    rows = pq.read_table(result.train_url).to_pylist()
    assert [r["ground_truth"] for r in rows] == ["72", "3234"]  # "3,234": commas stripped as verl does
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["72", "3234"]
    assert rows[0]["prompt"] == f"{GSM8K_ROWS[0]['question']} {GSM8K_INSTRUCTION}"

    # The row with no "#### N" goes to rejected.jsonl with the reason, nothing silently dropped.
    (rejected,) = [json.loads(line) for line in Path(result.rejected_url).read_text().splitlines()]
    assert rejected["row_index"] == 2 and rejected["kind"] == "no_answer"
    assert rejected["reason"] == "ground_truth: 'answer' has no '#### <number>' final answer"

    def gsm8k(response: str, truth: str) -> float:
        score = load_reward_fn("gsm8k")("openai/gsm8k", response, truth, {})
        return float(score["score"] if isinstance(score, dict) else score)

    right = "48 / 2 = 24 in May, 48 + 24 = 72.\n#### 72"
    wrong = "48 / 2 = 24 in May, 48 + 12 = 60.\n#### 60"
    assert gsm8k(right, rows[0]["ground_truth"]) == 1.0 and gsm8k(wrong, rows[0]["ground_truth"]) == 0.0
    assert gsm8k("3,000 + 234 = 3,234\n#### 3,234", rows[1]["ground_truth"]) == 1.0
    # Before the transforms the worked answer was the ground truth: a correct response scored 0.
    assert gsm8k(right, GSM8K_ROWS[0]["answer"]) == 0.0


def test_math_last_boxed_keeps_nested_braces_and_rejects_rows_without_a_box(tmp_path: Path, tokenizer: Any) -> None:
    rows = [
        {"problem": "Half of one?", "solution": "We get $\\boxed{2}$ wrong first, then $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Two plus two?", "solution": "It is 4."},
        {"problem": "Cut off?", "solution": "So $\\boxed{\\frac{1}{2}"},
    ]
    spec = PrepareSpec(
        source=_jsonl(tmp_path / "math.jsonl", rows),
        field_map={"prompt": "problem", "ground_truth": "solution|math_last_boxed"},
        max_prompt_length=512,
        val_fraction=0.0,
        max_rejected_fraction=1.0,
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r", tokenizer=tokenizer)
    assert [r["ground_truth"] for r in pq.read_table(result.train_url).to_pylist()] == ["\\frac{1}{2}"]
    reasons = [json.loads(line)["reason"] for line in Path(result.rejected_url).read_text().splitlines()]
    assert reasons == ["ground_truth: 'solution' has no complete \\boxed{...} answer"] * 2
    boxed = parse_field_source("ground_truth", "s|math_last_boxed")
    assert boxed.apply("\\boxed{a{b}c} and \\fbox{\\sqrt{2}}") == "\\sqrt{2}" and boxed.apply("$\\boxed 7$") == "7"
    score = load_reward_fn("math")("math", "so the answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", {})
    assert (score["score"] if isinstance(score, dict) else score) == 1.0


def test_a_transform_on_a_column_no_row_has_is_one_line_naming_it(tmp_path: Path, tokenizer: Any) -> None:
    spec = PrepareSpec(
        source=_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS),
        field_map={"prompt": "question", "ground_truth": "solution|gsm8k_final_answer"},
        max_prompt_length=512,
    )
    with pytest.raises(ValueError) as info:
        prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r", tokenizer=tokenizer)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("field_map.ground_truth: column 'solution' is in no row of the source; map ")
    assert "['answer', 'question']" in message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("answer|gsm8k", "unknown transform 'gsm8k'; use one of gsm8k_final_answer, math_last_boxed"),
        ("answer|template:no placeholder", "template needs a text with '{}'"),
        ("answer|strip:x", "transform 'strip' takes no ':' argument"),
        ("|strip", "no source column before the transforms"),
    ],
)
def test_bad_maps_are_one_line_everywhere(text: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        parse_field_source("ground_truth", text)
    with pytest.raises(ValidationError, match=message):  # the trigger form / spec
        PipelineParams(field_map={"ground_truth": text})


def test_prepare_data_cli_takes_transforms_and_prints_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS[:2])
    args = {
        "source": source,
        "out": str(tmp_path / "out"),
        "run_id": "r",
        "tokenizer": "builtin:tiny-llama",
        "max_prompt_length": 512,
        "val_fraction": 0.0,
        "no_chat_template": False,
        "field": ["prompt=question|template:Q: {} A:", "ground_truth=answer|gsm8k_final_answer"],
    }
    assert prepare_from_args(_namespace(args)) == 0
    result = json.loads(capsys.readouterr().out)
    rows = pq.read_table(result["train_url"]).to_pylist()
    assert [r["ground_truth"] for r in rows] == ["72", "3234"] and rows[0]["prompt"].startswith("Q: Natalia")
    assert prepare_from_args(_namespace({**args, "field": ["ground_truth=answer|nope"]})) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "field_map.ground_truth='answer|nope': unknown transform 'nope'" in err


def _namespace(values: dict[str, Any]) -> Any:
    import argparse

    return argparse.Namespace(**values)
