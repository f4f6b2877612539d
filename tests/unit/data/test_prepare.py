"""prepare_dataset on hand-made sources in tmp_path, measured with the tiny char-level tokenizer.

Token counts by hand (tiny tokenizer: one token per character, no special tokens on plain text; the chat
template is ``<bos>`` + ``<|role|>content\\n`` per message + ``<|assistant|>``):
    text "2+5="                                  -> 4 tokens
    chat [user "2+5="]                           -> 1 + (1 + 4 + 1) + 1 = 8 tokens
    chat [system "Be brief.", user "Q: copy: 7"] -> 1 + (1 + 9 + 1) + (1 + 10 + 1) + 1 = 25 tokens
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from rlhf_ops.data.dataset import PromptDataset
from rlhf_ops.data.prepare import (
    DataQualityError,
    PrepareSpec,
    prepare_dataset,
    split_point,
)
from rlhf_ops.data.prepare_cli import prepare_from_args
from rlhf_ops.models.resolve import resolve_model_path


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-llama"))


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def table(url: str) -> list[dict[str, Any]]:
    return pq.read_table(url.removeprefix("file://")).to_pylist()


def rejected(url: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(url).read_text().splitlines()]


def distinct_prompts(n: int) -> list[dict[str, str]]:
    """``n`` distinct arithmetic prompts: "a*b+c=" for a, b, c in 0..9 (1000 combinations)."""
    return [{"prompt": f"{i // 100}*{i // 10 % 10}+{i % 10}=", "ground_truth": str(i)} for i in range(n)]


def test_jsonl_nested_field_map_chat_with_system_prompt_and_template(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"question": "copy: 7", "answer": {"gt": 7}, "origin": "toy/copy_digit", "meta": {"id": 1, "b": [2]}}]
    spec = PrepareSpec(
        source=write_jsonl(tmp_path / "raw.jsonl", rows),
        field_map={"prompt": "question", "ground_truth": "answer.gt", "data_source": "origin", "extra_info": "meta"},
        prompt_format="chat",
        system_prompt="Be brief.",
        prompt_template="Q: {prompt}",
        max_prompt_length=25,  # exactly the 25 tokens of the formatted prompt: accepted
        val_fraction=0.0,
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r1", tokenizer=tokenizer)
    assert (result.num_train, result.num_val, result.num_rejected) == (1, 0, 0)
    assert table(result.train_url) == [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: copy: 7"}],
            "ground_truth": "7",  # the int 7 as text
            "data_source": "toy/copy_digit",
            "extra_info": '{"b": [2], "id": 1}',  # JSON with sorted keys
            "ability": "",
            "reward_model": {"ground_truth": "7", "style": "rule"},  # verl's copy of the ground truth
            "prompt_num_tokens": 25,
        }
    ]
    assert table(result.val_url) == []


def test_verl_parquet_layout_with_default_field_map(tmp_path: Path, tokenizer: Any) -> None:
    # verl's Parquet: chat prompt, answer nested under reward_model, extra_info a struct, ability.
    rows = [
        {
            "prompt": [{"role": "user", "content": "2+5="}],
            "reward_model": {"style": "model", "ground_truth": "7"},
            "data_source": "toy/add_digits",
            "ability": "math",
            "extra_info": {"index": 3, "split": "train"},
        }
    ]
    source = tmp_path / "verl.parquet"
    pd.DataFrame(rows).to_parquet(source, index=False)
    spec = PrepareSpec(source=f"file://{source}", max_prompt_length=8, val_fraction=0.0)
    result = prepare_dataset(spec, out_url=f"file://{tmp_path}/out", run_id="r1", tokenizer=tokenizer)
    assert table(result.train_url) == [
        {
            "prompt": [{"role": "user", "content": "2+5="}],
            "ground_truth": "7",
            "data_source": "toy/add_digits",
            "extra_info": '{"index": 3, "split": "train"}',
            "ability": "math",
            "reward_model": {"ground_truth": "7", "style": "model"},
            "prompt_num_tokens": 8,
        }
    ]
    # The trainer's dataset reads both the raw verl file and the prepared one, extra_info as a dict.
    for url in (str(source), result.train_url):
        dataset = PromptDataset.from_sources([url], tokenizer, max_prompt_length=8)
        assert (dataset.ground_truths, dataset.data_sources) == (["7"], ["toy/add_digits"])
        assert dataset.extra_infos == [{"index": 3, "split": "train"}]
        batch = dataset.batch([0, 0], pad_token_id=0, uid_prefix="t")
        assert list(batch.non_tensor_batch["extra_info"]) == [{"index": 3, "split": "train"}] * 2


def test_text_and_chat_formats(tmp_path: Path, tokenizer: Any) -> None:
    source = write_jsonl(tmp_path / "raw.jsonl", [{"prompt": "2+5="}, {"prompt": [{"role": "user", "content": "x"}]}])
    text = PrepareSpec(source=source, prompt_format="text", max_prompt_length=64, val_fraction=0.0, limit=1)
    result = prepare_dataset(text, out_url=str(tmp_path / "out"), run_id="text", tokenizer=tokenizer)
    assert [(r["prompt"], r["prompt_num_tokens"]) for r in table(result.train_url)] == [("2+5=", 4)]

    chat = text.model_copy(update={"prompt_format": "chat"})
    result = prepare_dataset(chat, out_url=str(tmp_path / "out"), run_id="chat", tokenizer=tokenizer)
    assert [(r["prompt"], r["prompt_num_tokens"]) for r in table(result.train_url)] == [
        ([{"role": "user", "content": "2+5="}], 8)
    ]

    # No limit: "text" rejects the chat row; "auto" writes the mix as chat (one Parquet type per column).
    strict = text.model_copy(update={"limit": None, "max_rejected_fraction": 0.5})
    result = prepare_dataset(strict, out_url=str(tmp_path / "out"), run_id="mixed-text", tokenizer=tokenizer)
    assert [r["kind"] for r in rejected(result.rejected_url)] == ["wrong_type"]
    auto = strict.model_copy(update={"prompt_format": "auto"})
    result = prepare_dataset(auto, out_url=str(tmp_path / "out"), run_id="mixed-auto", tokenizer=tokenizer)
    assert [r["prompt"] for r in table(result.train_url)] == [
        [{"role": "user", "content": "2+5="}],
        [{"role": "user", "content": "x"}],
    ]


def test_hf_datasets_folder_and_shard_folder(tmp_path: Path, tokenizer: Any) -> None:
    from datasets import Dataset

    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": "4"}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    spec = PrepareSpec(source=str(tmp_path / "hf"), max_prompt_length=64, val_fraction=0.0)
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="hf", tokenizer=tokenizer)
    assert [(r["prompt"], r["ground_truth"]) for r in table(result.train_url)] == [("1+1=", "2"), ("2+2=", "4")]
    assert {r["data_source"] for r in table(result.train_url)} == {str(tmp_path / "hf")}  # default: the source URL

    shards = tmp_path / "shards"
    shards.mkdir()
    pd.DataFrame(rows[:1]).to_parquet(shards / "part-0.parquet", index=False)
    write_jsonl(shards / "part-1.jsonl", rows[1:])
    (shards / "part-2.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "3+3="}\n'))
    # Skipped: markers, metadata .json, hidden files and partial output under _-prefixed folders.
    (shards / "_SUCCESS").write_text("")
    write_jsonl(shards / "meta.json", [{"prompt": "not data"}])
    write_jsonl(shards / ".part-3.jsonl.crc", ["junk"])
    write_jsonl(shards / "_temporary" / "part-4.jsonl", [{"prompt": "partial"}])
    spec = spec.model_copy(update={"source": str(shards)})
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="shards", tokenizer=tokenizer)
    assert [r["prompt"] for r in table(result.train_url)] == ["1+1=", "2+2=", "3+3="]  # shards in name order
    assert result.num_rejected == 0


def test_builtin_toy_source(tmp_path: Path, tokenizer: Any) -> None:
    spec = PrepareSpec(source="builtin:add_digits", max_prompt_length=64, limit=30, val_fraction=0.2, seed=3)
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="toy", tokenizer=tokenizer)
    rows = table(result.train_url) + table(result.val_url)
    assert result.num_train + result.num_val == len(rows) == 30 and result.num_rejected == 0
    for row in rows:
        a, b = row["prompt"][0]["content"].removesuffix("=").split("+")
        assert row["ground_truth"] == str(int(a) + int(b)) and row["data_source"] == "toy/add_digits"
        assert row["prompt_num_tokens"] == 8  # chat [user "a+b="]: 1 + (1 + 4 + 1) + 1


def test_bad_rows_go_to_rejected_jsonl_with_reasons(tmp_path: Path, tokenizer: Any) -> None:
    lines = [
        {"prompt": "1+1="},  # line 0: ok
        '{"prompt": "1+1=',  # line 1: unparseable
        {"question": "2+2="},  # line 2: no prompt field
        {"prompt": 5},  # line 3: wrong type
        {"prompt": "   "},  # line 4: empty
        {"prompt": "1+1=" * 20},  # line 5: 80 tokens > 64
        "[1, 2]",  # line 6: not an object
        {"prompt": "3+3=", "extra_info": "not json"},  # line 7: wrong extra_info
        "",  # line 8: blank, skipped
        {"prompt": "4+4=", "ground_truth": {"a": 1}},  # line 9: wrong ground_truth type
    ]
    spec = PrepareSpec(
        source=write_jsonl(tmp_path / "raw.jsonl", lines), max_prompt_length=64, max_rejected_fraction=1.0
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r", tokenizer=tokenizer)
    records = rejected(result.rejected_url)
    kinds = ["invalid_json", "missing_prompt", "wrong_type", "empty_prompt", "too_long", "not_an_object"]
    assert [(r["row_index"], r["kind"]) for r in records] == list(
        zip([1, 2, 3, 4, 5, 6, 7, 9], kinds + 2 * ["wrong_type"], strict=True)
    )
    assert {r["source"] for r in records} == {str(tmp_path / "raw.jsonl")}
    assert records[0]["row"] == '{"prompt": "1+1='  # the raw line
    assert records[4]["reason"] == "prompt has 80 tokens > max_prompt_length=64"
    assert len(records[4]["row"]) < 120
    assert (result.num_train + result.num_val, result.num_rejected) == (1, 8)
    manifest = json.loads(Path(result.manifest_url).read_text())
    assert manifest["counts"] == {"rows_read": 9, "train": result.num_train, "val": result.num_val, "rejected": 8}
    assert manifest["rejected_reasons"] == {"wrong_type": 3, **{k: 1 for k in kinds if k != "wrong_type"}}
    assert manifest["rejected_fraction"] == pytest.approx(8 / 9)


def test_threshold_error_names_share_threshold_and_file(tmp_path: Path, tokenizer: Any) -> None:
    lines: list[Any] = distinct_prompts(8) + ["{broken", "{broken"]  # 2 of 10 rejected = 0.2 > 0.1
    spec = PrepareSpec(source=write_jsonl(tmp_path / "raw.jsonl", lines), max_prompt_length=64, val_fraction=0.0)
    out = tmp_path / "out"
    prepare_dataset(
        spec.model_copy(update={"max_rejected_fraction": 0.5}), out_url=str(out), run_id="r", tokenizer=tokenizer
    )
    assert (out / "r" / "manifest.json").exists()
    with pytest.raises(DataQualityError) as info:  # the retry with a stricter gate fails...
        prepare_dataset(spec, out_url=str(out), run_id="r", tokenizer=tokenizer)
    message = str(info.value)
    assert "2 of 10 rows rejected, share 0.2000" in message and "max_rejected_fraction=0.1" in message
    assert f"{out}/r/rejected.jsonl" in message and "invalid_json: 2" in message
    assert (info.value.share, info.value.threshold, info.value.reasons) == (0.2, 0.1, {"invalid_json": 2})
    assert len(rejected(str(out / "r" / "rejected.jsonl"))) == 2  # ...after writing every rejected row
    assert sorted(p.name for p in (out / "r").iterdir()) == ["rejected.jsonl"]  # stale train/val/manifest gone


def test_split_is_deterministic_and_stable_when_rows_are_appended(tmp_path: Path, tokenizer: Any) -> None:
    rows = distinct_prompts(300)
    spec = PrepareSpec(source=write_jsonl(tmp_path / "a.jsonl", rows[:200]), max_prompt_length=64, val_fraction=0.2)
    first = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="a1", tokenizer=tokenizer)
    second = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="a2", tokenizer=tokenizer)
    for a, b in ((first.train_url, second.train_url), (first.val_url, second.val_url)):
        assert Path(a).read_bytes() == Path(b).read_bytes()
    val = {r["prompt"] for r in table(first.val_url)}
    assert val == {r["prompt"] for r in rows[:200] if split_point(r["prompt"], seed=0) < 0.2}
    assert 20 <= len(val) <= 60  # ~0.2 * 200 = 40 expected

    appended = spec.model_copy(update={"source": write_jsonl(tmp_path / "b.jsonl", rows[100:300] + rows[:100])})
    grown = prepare_dataset(appended, out_url=str(tmp_path / "out"), run_id="b", tokenizer=tokenizer)
    grown_val = {r["prompt"] for r in table(grown.val_url)}
    assert grown_val & {r["prompt"] for r in rows[:200]} == val  # no old row moved, whatever the order

    reseeded = prepare_dataset(
        spec.model_copy(update={"seed": 1}), out_url=str(tmp_path / "out"), run_id="c", tokenizer=tokenizer
    )
    assert {r["prompt"] for r in table(reseeded.val_url)} != val


def test_retry_rewrites_identical_files_and_manifest_hashes_verify(tmp_path: Path, tokenizer: Any) -> None:
    lines: list[Any] = distinct_prompts(40) + ["{broken"]
    spec = PrepareSpec(source=write_jsonl(tmp_path / "raw.jsonl", lines), max_prompt_length=64, val_fraction=0.25)
    names = ("train.parquet", "val.parquet", "rejected.jsonl")
    first = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="run-1", tokenizer=tokenizer)
    before = {name: (Path(first.run_url) / name).read_bytes() for name in names}
    again = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="run-1", tokenizer=tokenizer)
    assert again == first
    assert {name: (Path(first.run_url) / name).read_bytes() for name in names} == before
    assert not [p for p in Path(first.run_url).iterdir() if ".tmp-" in p.name]
    manifest = json.loads(Path(first.manifest_url).read_text())
    for name in names:
        entry = manifest["files"][name]
        assert entry["sha256"] == hashlib.sha256(before[name]).hexdigest() and entry["size"] == len(before[name])
    assert manifest["files"]["train.parquet"]["num_rows"] == first.num_train
    assert first.num_train + first.num_val == 40 and first.num_rejected == 1
    assert manifest["run_id"] == "run-1" and manifest["spec"]["val_fraction"] == 0.25
    assert manifest["tokenizer"]["name_or_path"] == resolve_model_path("builtin:tiny-llama")


def test_trainer_reads_the_output_with_equal_token_counts(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"prompt": p["prompt"], "ground_truth": p["ground_truth"]} for p in distinct_prompts(30)]
    spec = PrepareSpec(
        source=write_jsonl(tmp_path / "raw.jsonl", rows),
        prompt_format="chat",
        system_prompt="Answer:",
        max_prompt_length=24,
        val_fraction=0.3,
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r", tokenizer=tokenizer)
    for url in (result.train_url, result.val_url):
        written = table(url)
        dataset = PromptDataset.from_sources([url], tokenizer, max_prompt_length=24)
        assert dataset.num_dropped == 0 and len(dataset) == len(written) > 0
        assert [len(ids) for ids in dataset.prompt_ids] == [r["prompt_num_tokens"] for r in written]
        assert [r["prompt_num_tokens"] for r in written] == [19] * len(written)  # 1 + (1+7+1) + (1+6+1) + 1
        assert dataset.raw_prompts == [r["prompt"] for r in written]
        assert dataset.ground_truths == [r["ground_truth"] for r in written]


def test_val_source_overrides_the_split(tmp_path: Path, tokenizer: Any) -> None:
    rows = distinct_prompts(12)
    spec = PrepareSpec(
        source=write_jsonl(tmp_path / "train.jsonl", rows[:10]),
        val_source=write_jsonl(tmp_path / "val.jsonl", rows[10:]),
        max_prompt_length=64,
        val_fraction=0.5,  # ignored
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r", tokenizer=tokenizer)
    assert [r["prompt"] for r in table(result.train_url)] == [r["prompt"] for r in rows[:10]]
    assert [r["prompt"] for r in table(result.val_url)] == [r["prompt"] for r in rows[10:]]


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"field_map": {"answer": "x"}}, "field_map"),
        ({"prompt_template": "no placeholder"}, "prompt_template must contain"),
        ({"system_prompt": "hi"}, "system_prompt needs prompt_format='chat'"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"shuffle": True}, "shuffle"),
    ],
)
def test_spec_errors_name_the_field(update: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        PrepareSpec.model_validate({"source": "x.jsonl", "max_prompt_length": 8, **update})


def test_bad_run_id_and_missing_source(tmp_path: Path, tokenizer: Any) -> None:
    spec = PrepareSpec(source=str(tmp_path / "missing.jsonl"), max_prompt_length=8)
    with pytest.raises(ValueError, match="run_id='a/b'"):
        prepare_dataset(spec, out_url=str(tmp_path), run_id="a/b", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        prepare_dataset(spec, out_url=str(tmp_path), run_id="r", tokenizer=tokenizer)


def cli_args(tmp_path: Path, source: str, **overrides: Any) -> argparse.Namespace:
    args: dict[str, Any] = {
        "source": source,
        "out": str(tmp_path / "out"),
        "run_id": "cli",
        "tokenizer": "builtin:tiny-llama",
    }
    args.update(max_prompt_length=64, field=[], no_chat_template=False, val_source=None, val_fraction=None, seed=None)
    args.update(prompt_format=None, system_prompt=None, prompt_template=None, max_rejected_fraction=None, limit=None)
    return argparse.Namespace(**{**args, "default_data_source": None, **overrides})


def test_prepare_from_args_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "raw.jsonl", [{"q": "1+1=", "a": "2"}, "{broken"])
    assert prepare_from_args(cli_args(tmp_path, source, field=["prompt=q", "ground_truth=a"], val_fraction=0.0)) == 3
    assert "share 0.5000" in capsys.readouterr().err
    ok = cli_args(tmp_path, source, field=["prompt=q", "ground_truth=a"], max_rejected_fraction=0.5, val_fraction=0.0)
    assert prepare_from_args(ok) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["num_train"], printed["num_rejected"]) == (1, 1)
    assert table(printed["train_url"])[0]["prompt"] == "1+1="
    assert prepare_from_args(cli_args(tmp_path, source, field=["prompt"])) == 2
    assert "OURS=THEIRS" in capsys.readouterr().err
