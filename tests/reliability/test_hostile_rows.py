"""Hostile JSONL rows into ``rlhf prepare-data``: every row accounted for, each rejected one with its reason.

A seeded generator writes rows whose outcome is known in advance (a good row is accepted, a hostile one is
rejected with a given kind, a blank line is skipped), then the real CLI prepares them. The test checks the
exact kind of every rejected row by its line index, and accepted + rejected + blank = lines written.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.reliability.conftest import Figures

Line = tuple[bytes, str]  # (the line without its newline, expected outcome: "accepted", "blank" or a reject kind)


def _good(rng: random.Random) -> Line:
    digit = rng.randrange(10)
    row = {"prompt": f"copy {digit}", "ground_truth": str(digit)}
    if rng.random() < 0.3:
        row["data_source"] = rng.choice(["openai/gsm8k", "toy/copy_digit", "lighteval/MATH"])
    return json.dumps(row).encode(), "accepted"


def _row(obj: object, kind: str) -> Line:
    return json.dumps(obj).encode(), kind


HOSTILE: list[Line] = [
    _row({"question": "copy 1"}, "missing_prompt"),
    _row({"prompt": None, "ground_truth": "1"}, "missing_prompt"),
    _row({"prompt": 5}, "wrong_type"),
    _row({"prompt": True}, "wrong_type"),
    _row({"prompt": {"text": "copy 1"}}, "wrong_type"),
    _row({"prompt": [1, 2]}, "wrong_type"),
    _row({"prompt": [{"role": "user"}]}, "wrong_type"),
    _row({"prompt": []}, "empty_prompt"),
    _row({"prompt": "   "}, "empty_prompt"),
    _row({"prompt": "copy 1", "ground_truth": {"a": 1}}, "wrong_type"),
    _row({"prompt": "copy 1", "extra_info": [1, 2]}, "wrong_type"),
    _row({"prompt": "a\x00b"}, "invalid_text"),  # JSON-escaped NUL
    _row({"prompt": "copy 1", "ground_truth": "\x00"}, "invalid_text"),
    (b'{"prompt": "a\\ud800b"}', "invalid_text"),  # lone surrogate, valid JSON
    (b'{"prompt": "copy 1", "ground_truth": "\\udc00"}', "invalid_text"),
    (b'{"\\udfff": 1, "prompt": "copy 1"}', "invalid_text"),
    _row({"prompt": "copy 1", "data_source": "../../etc"}, "unsafe_data_source"),
    _row({"prompt": "copy 1", "data_source": "/abs/path"}, "unsafe_data_source"),
    _row({"prompt": "copy 1", "data_source": "a\\..\\b"}, "unsafe_data_source"),
    _row([1, 2, 3], "not_an_object"),
    _row("a string", "not_an_object"),
    _row(None, "not_an_object"),
    _row(42, "not_an_object"),
    (b'{"prompt": "copy 1"', "invalid_json"),
    (b'{"prompt": "copy 1"} trailing', "invalid_json"),
    (b"{'prompt': 'single quotes'}", "invalid_json"),
    (b'{"prompt": "\xff\xfe invalid utf-8"}', "invalid_json"),
    (b'{"prompt": "raw \x00 NUL"}', "invalid_json"),  # a raw control character inside a JSON string
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # nesting past the parser's recursion limit
    (b'{"prompt": ' + b"9" * 5000 + b"}", "invalid_json"),  # an integer past Python's 4300-digit limit
    (b"NaN", "not_an_object"),
]
LONG = _row({"prompt": "1 " * 100_000}, "too_long")  # 100k tokens (and more) against max_prompt_length=64; once
BLANK: list[Line] = [(b"", "blank"), (b"   ", "blank"), (b"\t", "blank"), (b"\r", "blank")]


def write_rows(path: Path, n: int, *, seed: int, long_prompts: int = 1) -> list[str]:
    """Writes ``n`` lines (about 1/3 good, 1/10 blank, the rest hostile, ``long_prompts`` 100k-token prompts at
    random places: tokenising one takes seconds); returns each line's expected outcome."""
    rng = random.Random(seed)
    draws = [rng.random() for _ in range(n)]
    lines = [_good(rng) if r < 0.33 else rng.choice(BLANK if r < 0.43 else HOSTILE) for r in draws]
    for i in rng.sample(range(n), long_prompts):
        lines[i] = LONG
    path.write_bytes(b"".join(line + b"\n" for line, _ in lines))
    return [kind for _, kind in lines]


def account(run_dir: Path, expected: list[str]) -> dict[str, int]:
    """Checks every line's outcome against ``expected``; returns the counts."""
    rejected = [json.loads(line) for line in (run_dir / "rejected.jsonl").read_text(encoding="utf-8").splitlines()]
    got = {r["row_index"]: r["kind"] for r in rejected}
    assert len(got) == len(rejected), "a row was rejected twice"
    assert all(r["reason"] and len(r["row"]) < 700 for r in rejected)
    want = {i: kind for i, kind in enumerate(expected) if kind not in ("accepted", "blank")}
    assert got == want, {i: (got.get(i), want.get(i)) for i in set(got) | set(want) if got.get(i) != want.get(i)}
    accepted = sum(pq.read_metadata(run_dir / name).num_rows for name in ("train.parquet", "val.parquet"))
    counts = Counter(expected)
    assert accepted == counts["accepted"]
    blank = counts["blank"]
    assert accepted + len(rejected) + blank == len(expected)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["counts"]["rows_read"] == len(expected) - blank
    return {"rows": len(expected), "accepted": accepted, "rejected": len(rejected), "blank": blank}


def test_hostile_rows_through_the_cli_are_all_accounted_for(tmp_path: Path, figures: Figures) -> None:
    source = tmp_path / "hostile.jsonl"
    expected = write_rows(source, 300, seed=15)
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "prepare-data", str(source), "--out", str(tmp_path / "out")]
    cmd += ["--run-id", "r1", "--tokenizer", "builtin:tiny-llama", "--max-prompt-length", "64"]
    proc = subprocess.run([*cmd, "--max-rejected-fraction", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    counts = account(tmp_path / "out" / "r1", expected)
    assert counts["rejected"] >= 100 and counts["accepted"] >= 60
    figures.record(**counts, kinds=dict(Counter(k for k in expected if k not in ("accepted", "blank"))))


@pytest.mark.slow
def test_3000_hostile_rows_in_process(tmp_path: Path, figures: Figures) -> None:
    from rlhf_ops.data.images import load_tokenizer_or_processor
    from rlhf_ops.data.prepare import PrepareSpec, prepare_dataset
    from rlhf_ops.models.resolve import resolve_model_path

    source = tmp_path / "hostile.jsonl"
    expected = write_rows(source, 3000, seed=1515, long_prompts=5)
    spec = PrepareSpec(source=str(source), max_prompt_length=64, max_rejected_fraction=1.0)
    tokenizer = load_tokenizer_or_processor(resolve_model_path("builtin:tiny-llama"))
    prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r1", tokenizer=tokenizer)
    figures.record(**account(tmp_path / "out" / "r1", expected))


@pytest.mark.slow  # the threshold itself is unit-tested (tests/unit/data/test_prepare.py); this is the CLI line
def test_too_many_hostile_rows_fail_in_one_line_naming_the_share(tmp_path: Path) -> None:
    source = tmp_path / "hostile.jsonl"
    write_rows(source, 60, seed=3, long_prompts=0)
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "prepare-data", str(source), "--out", str(tmp_path / "out")]
    cmd += ["--run-id", "r1", "--tokenizer", "builtin:tiny-llama", "--max-prompt-length", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 3 and len(errors) == 1 and "max_rejected_fraction=0.1" in errors[0], proc.stderr
    assert not (tmp_path / "out" / "r1" / "train.parquet").exists()
