"""``rlhf sft`` on the tiny model: the loss by hand, accumulation invariance, a run that learns and writes a model
folder that loads and generates, and bad input as one line per problem naming the key."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.config.sft import load_sft_config
from rlhf_ops.models.tiny import build_tiny_tokenizer
from rlhf_ops.trainer.sft import SFTExample, collate, encode_rows, epoch_steps, sft_loss, steps_per_epoch
from workers.entrypoints.sft import main
from workers.sft.trainer import SFT_INFO_FILE, _train_step

CHATS = [("2+3=", "5"), ("4+4=", "8"), ("1+6=", "7"), ("3+2=", "5"), ("0+9=", "9"), ("5+1=", "6")]


def _write_chats(path: Path, repeat: int = 4) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"the sum is {a}"}]}
        for q, a in CHATS * repeat
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_loss_by_hand() -> None:
    # uniform logits over V = 4: every predicted token costs ln 4. Row 0 learns tokens 1 and 2, row 1 token 2 only:
    # 3 tokens -> 3 ln 4, divided by num_tokens = 6 (a step twice this micro-batch's size) -> ln 4 / 2
    logits = torch.zeros(2, 3, 4)
    ids = torch.tensor([[0, 1, 2], [3, 0, 1]])
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    loss, summed = sft_loss(logits, ids, mask, num_tokens=6)
    torch.testing.assert_close(loss, torch.tensor(math.log(4) / 2))
    torch.testing.assert_close(summed, torch.tensor(3 * math.log(4)))


def test_sft_loss_ignores_unmasked_targets() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 50.0  # position 0 predicts token 1 = 2 with certainty; position 1 predicts token 2 = 0
    ids = torch.tensor([[1, 2, 0]])
    loss, _ = sft_loss(logits, ids, torch.tensor([[0, 1, 0]]), num_tokens=1)  # only token 1 counts: ~0 loss
    assert float(loss) < 1e-6
    loss, _ = sft_loss(logits, ids, torch.tensor([[0, 0, 1]]), num_tokens=1)  # only token 2: ln 4
    torch.testing.assert_close(loss, torch.tensor(math.log(4)))


def test_epoch_steps_see_every_row_once_in_accumulated_micro_batches() -> None:
    steps = epoch_steps(10, epoch=0, seed=0, micro_batch_size=2, grad_accum_steps=2)
    assert [[len(m) for m in s] for s in steps] == [[2, 2], [2, 2], [2]]
    assert sorted(i for s in steps for m in s for i in m) == list(range(10))
    assert steps_per_epoch(10, micro_batch_size=2, grad_accum_steps=2) == 3
    assert epoch_steps(10, epoch=1, seed=0, micro_batch_size=2, grad_accum_steps=2) != steps  # reshuffled


def test_one_micro_batch_of_four_equals_four_of_one(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in CHATS[:4]]
    rows[1]["messages"][1]["content"] = "a longer answer"  # rows of different lengths: padding must not count
    examples = encode_rows(
        rows, tokenizer, eos_token_id=tokenizer.eos_token_id, schemas=[], examples=[], max_length=64, source="t"
    )
    grads = []
    for split in ([examples], [[e] for e in examples]):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        loss, tokens = _train_step(model, [collate(part, pad_token_id=0) for part in split])
        grads.append((loss, tokens, [p.grad.clone() for p in model.parameters()]))
    (loss_a, tokens_a, grads_a), (loss_b, tokens_b, grads_b) = grads
    assert tokens_a == tokens_b == 2 + 16 + 2 + 2  # "5<eos>", "a longer answer<eos>", "7<eos>", "5<eos>"
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def _overrides(tmp_path: Path, data: Path, **extra: Any) -> list[str]:
    base = {
        "model.path": "builtin:tiny-llama",
        "data.train_files": f"[{data}]",
        "data.max_length": 64,
        "trainer.output_dir": str(tmp_path / "sft-model"),
        "trainer.epochs": 6,
        "trainer.micro_batch_size": 4,
        "trainer.grad_accum_steps": 2,
        "trainer.num_threads": 1,
        "optim.lr": 3e-3,
        "optim.lr_warmup_steps": 2,
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


def test_a_tiny_run_learns_and_writes_a_model_that_loads_and_generates(tmp_path: Path, capsys: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _write_chats(tmp_path / "chats.jsonl")  # 24 rows, 3 steps per epoch, 18 steps
    assert main(_overrides(tmp_path, data)) == 0
    out = tmp_path / "sft-model"
    assert capsys.readouterr().out.strip().endswith(str(out))
    metrics = [json.loads(line) for line in (tmp_path / "sft-model.metrics.jsonl").read_text().splitlines()]
    losses = [m["sft/loss"] for m in metrics]
    assert len(losses) == 18 and metrics[0]["sft/lr"] == 0.0 and metrics[2]["sft/lr"] == pytest.approx(3e-3)
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses  # the answers are learnable: "the sum is N"
    info = json.loads((out / SFT_INFO_FILE).read_text())
    assert info["optimizer_steps"] == 18 and info["conversations"] == 24
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    umask = os.umask(0o022)
    os.umask(umask)  # read it back (the test runs single-threaded here)
    # other users (the RL job, a server) read the folder: open()'s modes, not mkdtemp's 0700 / safetensors' 0600
    assert {p.name: p.stat().st_mode & 0o777 for p in [out, out / "model.safetensors"]} == {
        out.name: 0o777 & ~umask,
        "model.safetensors": 0o666 & ~umask,
    }
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+3="}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    generated = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).startswith("the sum is")


def _errors(capsys: Any) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_bad_config_values_give_one_line_each_naming_the_key(tmp_path: Path, capsys: Any) -> None:
    data = _write_chats(tmp_path / "chats.jsonl")
    bad = _overrides(
        tmp_path, data, **{"trainer.micro_batch_size": 0, "data.tool_prompt": "examples", "trainer.epoch": 2}
    )
    assert main(bad) == 2
    lines = _errors(capsys)
    assert len(lines) == 3, lines
    assert any(
        line.startswith("error: trainer.micro_batch_size:") and "Fix: set a value > 0" in line for line in lines
    )
    assert any(line.startswith("error: data.tool_prompt:") and "'schemas'" in line for line in lines)
    assert any(line.startswith("error: trainer.epoch:") and "did you mean 'trainer.epochs'" in line for line in lines)


def test_cross_field_problems_name_the_key(tmp_path: Path, capsys: Any) -> None:
    assert main(_overrides(tmp_path, Path("x.jsonl"), **{"data.train_files": "[builtin:calculator_sft]"})) == 2
    (line,) = _errors(capsys)
    assert line.startswith("error: data.tools: builtin:calculator_sft calls the calculator") and "Fix: add" in line
    with pytest.raises(Exception, match="data.tool_prompt: 'example' needs tools"):
        load_sft_config(None, _overrides(tmp_path, Path("x.jsonl"), **{"data.tool_prompt": "example"}))


def test_bad_data_gives_one_line_naming_the_file_and_row(tmp_path: Path, capsys: Any) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    assert main(_overrides(tmp_path, data)) == 2
    (line,) = _errors(capsys)
    assert line == f"error: data.train_files: {data} row 0: there is no assistant turn to learn; fix the row " + (
        "(rows are {'messages': [...]}, OpenAI chat format)"
    )
    assert main(_overrides(tmp_path, tmp_path / "missing.jsonl")) == 2
    (line,) = _errors(capsys)
    assert line.startswith(f"error: data.train_files: {tmp_path / 'missing.jsonl'} not found")


def test_an_existing_output_folder_is_kept_without_overwrite(tmp_path: Path, capsys: Any) -> None:
    data = _write_chats(tmp_path / "chats.jsonl", repeat=1)
    (tmp_path / "sft-model").mkdir()
    assert main(_overrides(tmp_path, data)) == 2
    (line,) = _errors(capsys)
    assert line.startswith("error: trainer.output_dir:") and "set trainer.overwrite=true" in line


def test_collate_right_pads_ids_attention_and_loss_mask() -> None:
    batch = collate([SFTExample([5, 6, 7], [0, 1, 1]), SFTExample([8], [1])], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


def test_mlflow_gets_the_loss_of_every_step(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data = _write_chats(tmp_path / "chats.jsonl", repeat=1)  # 6 rows, 1 step per epoch
    extra = {"trainer.epochs": 2, "trainer.logger": "[jsonl,mlflow]", "tracking.mlflow_uri": uri}
    assert main(_overrides(tmp_path, data, **extra)) == 0
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlhf-sft").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["rlhf.stage"] == "sft"
    history = client.get_metric_history(run.info.run_id, "sft/loss")
    assert [m.step for m in history] == [1, 2]
    jsonl = [json.loads(line)["sft/loss"] for line in (tmp_path / "sft-model.metrics.jsonl").read_text().splitlines()]
    assert [m.value for m in history] == pytest.approx(jsonl)
    assert run.data.params["optim.lr"] == "0.003"
