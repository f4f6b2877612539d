"""Pre-flight: every error path of :func:`preflight_problems`, on real folders, files and closed ports."""

from __future__ import annotations

import json
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from rlhf_ops.config import ConfigProblem, RunConfig, load_config
from rlhf_ops.pipeline.preflight import PreflightError, preflight_problems, raise_if_problems

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _safetensors(path: Path, *, data_bytes: int = 8, truncate: int = 0) -> None:
    # header: one F32 tensor of 2 values at bytes [0, 8) of the data section
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * (data_bytes - truncate))


def _model_dir(root: Path, *, tokenizer_config: dict[str, Any] | None = None) -> Path:
    """A minimal HF folder as save_pretrained lays it out (pre-flight reads only these files)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _safetensors(root / "model.safetensors")
    (root / "tokenizer.json").write_text("{}")
    config = {"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(config if tokenizer_config is None else tokenizer_config))
    return root


def _data(root: Path, rows: list[dict[str, Any]], name: str = "train.jsonl") -> Path:
    path = root / name
    if name.endswith(".parquet"):
        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_ROWS = [{"prompt": [{"role": "user", "content": "2+2?"}], "ground_truth": "4", "data_source": "t"}]


def _config(tmp_path: Path, *overrides: str, model: Path | None = None, data: Path | None = None) -> RunConfig:
    model = model or _model_dir(tmp_path / "model")
    data = data or _data(tmp_path, CHAT_ROWS)
    base = [f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "trainer.logger=[console]"]
    return load_config("tiny-cpu", [*base, "data.apply_chat_template=true", *overrides])


def _by_key(problems: list[ConfigProblem]) -> dict[str, str]:
    return {p.key: str(p) for p in problems}


def _closed_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_complete_run_has_no_problem(tmp_path: Path) -> None:
    notes: list[str] = []
    assert preflight_problems(_config(tmp_path), notes=notes) == []
    assert notes == []  # pad '<pad>' != eos '<eos>': nothing to say


def test_pad_equal_to_eos_is_a_note(tmp_path: Path) -> None:
    tokens = {"eos_token": "</s>", "pad_token": "</s>", "chat_template": TEMPLATE}
    notes: list[str] = []
    assert (
        preflight_problems(_config(tmp_path, model=_model_dir(tmp_path / "m", tokenizer_config=tokens)), notes=notes)
        == []
    )
    assert notes == [
        "model.path: pad == eos ('</s>'); a response keeps its first eos in the mask and the reward, the padding "
        "after it is masked"
    ]


def test_the_built_tiny_llama_folder_passes(tiny_model_dir: str, tmp_path: Path) -> None:
    # a real save_pretrained folder (safetensors, tokenizer.json, chat_template.jinja)
    assert preflight_problems(_config(tmp_path, model=Path(tiny_model_dir))) == []


def test_the_real_smollm2_folder_passes_and_says_how_pad_eos_is_handled(tmp_path: Path) -> None:
    from tests.support.real_model import smollm2_path

    model = Path(smollm2_path())  # bf16 safetensors, tokenizer.json, chat_template.jinja, pad == eos
    notes: list[str] = []
    assert preflight_problems(_config(tmp_path, model=model), notes=notes) == []
    assert notes == [
        "model.path: pad == eos ('<|im_end|>'); a response keeps its first eos in the mask and the reward, "
        "the padding after it is masked"
    ]


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text("{}"), "config.json has no model_type"),
        (lambda d: (d / "model.safetensors").unlink(), "has no weights (*.safetensors, *.bin or a sharded index)"),
        (
            lambda d: (d / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid x\n"),
            "model.safetensors is not a safetensors file (a Git LFS pointer or a truncated download?)",
        ),
        (lambda d: _safetensors(d / "model.safetensors", truncate=3), "model.safetensors is truncated"),
        (
            lambda d: (d / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})
            ),
            "model.safetensors.index.json lists shards missing from",
        ),
    ],
)
def test_a_broken_model_folder_is_one_line_naming_model_path(tmp_path: Path, breakage: Any, message: str) -> None:
    model = _model_dir(tmp_path / "model")
    breakage(model)
    problems = [str(p) for p in preflight_problems(_config(tmp_path, model=model))]
    assert len(problems) == 1 and problems[0].startswith("model.path: ") and message in problems[0], problems


def test_a_missing_model_folder(tmp_path: Path) -> None:
    problems = _by_key(preflight_problems(_config(tmp_path, model=tmp_path / "nowhere")))
    assert list(problems) == ["model.path"] and "is not a folder visible here" in problems["model.path"]


def test_missing_tokenizer_files_and_eos(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", tokenizer_config={"chat_template": TEMPLATE})
    (model / "tokenizer.json").unlink()
    problems = [str(p) for p in preflight_problems(_config(tmp_path, model=model))]
    assert problems == [
        f"model.path: {model} has no tokenizer (tokenizer.json, tokenizer.model, vocab.json, vocab.txt). "
        "Fix: save the tokenizer there too",
        f"model.path: the tokenizer in {model} has no eos_token (the trainer stops and masks responses at it). "
        'Fix: add "eos_token": "<end-of-turn token>" to its tokenizer_config.json',
    ]


def test_a_separate_tokenizer_folder_is_checked_under_its_own_key(tmp_path: Path) -> None:
    problems = _by_key(preflight_problems(_config(tmp_path, f"model.tokenizer_path={tmp_path / 'tok'}")))
    assert list(problems) == ["model.tokenizer_path"] and "is not a folder visible here" in str(problems)


def test_no_pad_token_is_a_note_not_a_problem(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", tokenizer_config={"eos_token": {"content": "<|im_end|>"}})
    (model / "chat_template.jinja").write_text(TEMPLATE)  # transformers 5 writes the template beside the config
    notes: list[str] = []
    assert preflight_problems(_config(tmp_path, model=model), notes=notes) == []
    assert notes == ["model.path: no pad token; the platform pads with the eos token '<|im_end|>'"]


def test_chat_template_is_only_needed_when_it_would_be_applied(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", tokenizer_config={"eos_token": "<eos>", "pad_token": "<pad>"})
    assert _by_key(preflight_problems(_config(tmp_path, model=model))).keys() == {"data.apply_chat_template"}
    assert preflight_problems(_config(tmp_path, "data.apply_chat_template=false", model=model)) == []
    text_rows = _data(tmp_path, [{"prompt": "2+2?", "ground_truth": "4"}], "text.jsonl")
    assert preflight_problems(_config(tmp_path, model=model, data=text_rows)) == []


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def score(text):\n    return 1.0\n", "score(text) cannot be called positionally"),
        (
            "def score(data_source, solution, ground_truth, extra_info=None):\n    return 1.0\n",
            "cannot be called by keyword with (data_source, solution_str, ground_truth, extra_info)",
        ),
        ("raise RuntimeError('needs a GPU')\n", "needs a GPU"),
        ("score = 3\n", "not callable"),
    ],
)
def test_a_reward_function_that_cannot_be_called_as_verl_calls_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, message: str
) -> None:
    name = _module(tmp_path, monkeypatch, f"reward_mod_{abs(hash(source))}", source)
    problems = _by_key(preflight_problems(_config(tmp_path, f"reward.reward_fn={name}:score")))
    assert list(problems) == ["reward.reward_fn"] and message in problems["reward.reward_fn"], problems


def test_a_good_user_reward_function_and_the_builtins_pass(tmp_path: Path) -> None:
    for spec in ["tests.support.rewards:starts_with_five", "toy", "copy_digit"]:
        assert preflight_problems(_config(tmp_path, f"reward.reward_fn={spec}")) == [], spec


def test_an_unimportable_reward_module(tmp_path: Path) -> None:
    problems = _by_key(preflight_problems(_config(tmp_path, "reward.reward_fn=nope:fn")))
    assert list(problems) == ["reward.reward_fn"]
    assert (
        "cannot import module 'nope'" in problems["reward.reward_fn"]
        and "Fix: install" in problems["reward.reward_fn"]
    )


def test_a_missing_data_file_names_data_train_files(tmp_path: Path) -> None:
    problems = _by_key(preflight_problems(_config(tmp_path, data=Path("/nonexistent.jsonl"))))
    assert problems == {
        "data.train_files": "data.train_files: /nonexistent.jsonl does not exist. Fix: fix the URL, or run "
        "`rlhf prepare-data` and point data at its train.parquet / val.parquet"
    }


@pytest.mark.parametrize("name", ["train.parquet", "train.jsonl"])
def test_a_data_file_without_the_prompt_or_ground_truth_column(tmp_path: Path, name: str) -> None:
    data = _data(tmp_path, [{"question": "2+2?", "answer": "4"}], name)
    problems = _by_key(preflight_problems(_config(tmp_path, data=data)))
    assert set(problems) == {"data.prompt_key", "data.ground_truth_key"}
    assert f"{data} has no column 'prompt' (columns: answer, question)" in problems["data.prompt_key"]
    fixed = preflight_problems(
        _config(tmp_path, "data.prompt_key=question", "data.ground_truth_key=answer", data=data)
    )
    assert fixed == []


def test_ground_truth_is_not_needed_without_a_rule_reward(tmp_path: Path) -> None:
    data = _data(tmp_path, [{"prompt": "2+2?"}], "train.parquet")
    rm = _model_dir(tmp_path / "rm")
    config = _config(tmp_path, "reward.reward_fn=null", f"reward.model_path={rm}", data=data)
    assert preflight_problems(config) == []


def test_verl_layout_nested_ground_truth_and_empty_and_unreadable_files(tmp_path: Path) -> None:
    rows = [{"prompt": CHAT_ROWS[0]["prompt"], "reward_model": {"ground_truth": "4", "style": "rule"}}]
    verl = _data(tmp_path, rows, "verl.parquet")
    assert preflight_problems(_config(tmp_path, "data.ground_truth_key=reward_model.ground_truth", data=verl)) == []
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "has no rows" in _by_key(preflight_problems(_config(tmp_path, data=empty)))["data.train_files"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "ground_truth": "b"}\n{"prompt": \n')
    assert "cannot read" in _by_key(preflight_problems(_config(tmp_path, data=broken)))["data.train_files"]
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,ground_truth\n")
    assert "neither .parquet, .jsonl nor an HF datasets folder" in str(preflight_problems(_config(tmp_path, data=csv)))


def test_an_hf_datasets_folder_is_read_from_its_features(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": CHAT_ROWS[0]["prompt"], "reward_model": {"ground_truth": "4"}}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    config = _config(tmp_path, "data.ground_truth_key=reward_model.ground_truth", data=tmp_path / "ds")
    assert preflight_problems(config) == []
    problems = _by_key(preflight_problems(_config(tmp_path, data=tmp_path / "ds")))  # no top-level ground_truth
    assert list(problems) == ["data.ground_truth_key"], problems
    # chat prompts were recognised: a tokenizer without a template is refused for them
    model = _model_dir(tmp_path / "plain", tokenizer_config={"eos_token": "<eos>"})
    config = _config(tmp_path, "data.ground_truth_key=reward_model.ground_truth", data=tmp_path / "ds", model=model)
    assert [p.key for p in preflight_problems(config)] == ["data.apply_chat_template"]


def test_an_unreachable_s3_endpoint_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    start = time.monotonic()
    problems = _by_key(preflight_problems(_config(tmp_path, "trainer.remote_store_url=s3://bucket/prefix")))
    assert time.monotonic() - start < 20  # the probe's deadline is 10 s
    assert list(problems) == ["trainer.remote_store_url"]
    assert "cannot write to s3://bucket/prefix" in problems["trainer.remote_store_url"]


def test_a_writable_remote_store_is_probed_and_cleaned_up(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    config = _config(tmp_path, f"trainer.remote_store_url=file://{remote}", "trainer.run_name=r1")
    assert preflight_problems(config) == []
    assert (remote / "tiny-cpu" / "r1").is_dir() and not list(remote.rglob(".preflight-*"))


def test_an_unreachable_mlflow_server_only_matters_with_the_mlflow_logger(tmp_path: Path) -> None:
    uri = f"tracking.mlflow_uri=http://user:secret@127.0.0.1:{_closed_port()}"
    assert preflight_problems(_config(tmp_path, uri)) == []  # logger is console only
    problems = _by_key(preflight_problems(_config(tmp_path, uri, "trainer.logger=[console,mlflow]")))
    assert list(problems) == ["tracking.mlflow_uri"] and "does not answer" in problems["tracking.mlflow_uri"]
    assert "secret" not in problems["tracking.mlflow_uri"]


def test_resume_from_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "global_step_3"
    folder.mkdir()
    problems = _by_key(preflight_problems(_config(tmp_path, f"trainer.resume_mode={folder}")))
    assert list(problems) == ["trainer.resume_mode"] and "not a complete checkpoint" in problems["trainer.resume_mode"]


def test_every_problem_at_once_and_the_error_lists_them(tmp_path: Path) -> None:
    config = _config(tmp_path, "reward.reward_fn=nope:fn", data=Path("/nonexistent.jsonl"))
    with pytest.raises(PreflightError) as caught:
        raise_if_problems(config)
    assert [p.key for p in caught.value.problems] == ["data.train_files", "reward.reward_fn"]
    assert str(caught.value).startswith("preflight found 2 problem(s); nothing was started:\n  - data.train_files: ")


def test_preflight_imports_no_torch(tmp_path: Path) -> None:
    # the Airflow preflight task runs these checks in the worker process, which must stay torch-free
    import subprocess

    config = _config(tmp_path, "reward.reward_fn=copy_digit")
    code = (
        "import sys; from rlhf_ops.config import RunConfig\n"
        "from rlhf_ops.pipeline.preflight import preflight_problems\n"
        f"c = RunConfig.model_validate_json({config.model_dump_json()!r})\nassert preflight_problems(c) == []\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
