"""The tiny model directory: files, determinism, idempotence, tokenizer, critic and reward-model loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging

from rlhf_ops.models import TINY_MODEL_DEFAULTS, build_tiny_model_dir
from rlhf_ops.models.tiny import build_tiny_tokenizer, make_tiny_config
from tests.support.builders import build_tiny_reward_model_dir

hf_logging.set_verbosity_error()  # the critic test expects "newly initialized score" reports


def test_model_dir_has_the_standard_files_and_config(tiny_model_dir: str) -> None:
    names = {p.name for p in Path(tiny_model_dir).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja"} <= names
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    # 7 special tokens + 10 digits + 26 + 26 letters + 15 punctuation/space characters = 84
    assert config["vocab_size"] == 84
    assert config["hidden_size"] == 64 and config["num_attention_heads"] == 2 and config["head_dim"] == 32
    assert config["num_hidden_layers"] == 2 and config["intermediate_size"] == 128
    assert config["max_position_embeddings"] == 512 and config["tie_word_embeddings"] is False
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    tok_config = json.loads((Path(tiny_model_dir) / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x and 5.x


def test_from_pretrained_logits_equal_the_seeded_in_memory_model(tiny_model_dir: str) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    config = make_tiny_config(build_tiny_tokenizer(), **TINY_MODEL_DEFAULTS)
    torch.manual_seed(0)  # build_tiny_model_dir's default seed
    fresh = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 19, 31, 32, 41, 71, 69, 14]])  # <bos>copy: 7
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    assert loaded.dtype == torch.float32


def test_build_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    first = build_tiny_model_dir(tmp_path / "a", seed=3)
    second = build_tiny_model_dir(tmp_path / "b", seed=3)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model_dir(tmp_path / "a", seed=3) == first  # reused, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    other = build_tiny_model_dir(tmp_path / "c", seed=4)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_build_into_an_existing_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert (build_tiny_model_dir(tmp_path / "m") / "config.json").exists()


def test_build_rejects_a_directory_built_with_other_arguments(tmp_path: Path) -> None:
    build_tiny_model_dir(tmp_path / "m", seed=0)
    with pytest.raises(ValueError, match="out_dir=.*already exists.*pass another out_dir"):
        build_tiny_model_dir(tmp_path / "m", seed=1)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("user data")
    with pytest.raises(ValueError, match="already exists"):
        build_tiny_model_dir(tmp_path / "other")


def test_head_dim_below_32_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim = hidden_size / num_heads = 16 < 32"):
        build_tiny_model_dir(tmp_path / "m", num_heads=4)  # 64 / 4 = 16
    with pytest.raises(ValueError, match="multiple of num_heads"):
        build_tiny_model_dir(tmp_path / "m", hidden_size=96, num_heads=5)


def test_tokenizer_round_trip_padding_and_chat_template(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left" and len(tok) == 84
    # ids: 7 specials first, then "0".."9" = 7..16, "a".."z" = 17..42; "7" = 7 + 7 = 14, "c" = 17 + 2 = 19
    assert tok("7c")["input_ids"] == [14, 19]
    text = "copy: 7\nHello, World! (2+5=7?)"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.decode(tok("é")["input_ids"]) == "<unk>"  # outside the alphabet
    batch = tok(["7", "12"], padding=True)
    assert batch["input_ids"] == [[0, 14], [8, 9]] and batch["attention_mask"] == [[0, 1], [1, 1]]
    assert tok.decode([14, 2, 0, 0], skip_special_tokens=True) == "7"
    chat = [{"role": "user", "content": "copy: 7"}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><|user|>copy: 7\n<|assistant|>"
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids[:2] == [1, 5] and ids[-1] == 6 and tok.decode(ids) == rendered  # <bos>=1, <|user|>=5, <|assistant|>=6


def test_critic_loads_from_the_policy_dir_with_a_fresh_value_head(tiny_model_dir: str) -> None:
    # transformers 5: from_pretrained(..., classifier_dropout=0.0) raises; set it on the config instead.
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels, config.classifier_dropout = 1, 0.0
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, config=config)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert critic.dropout.p == 0.0  # the generic head defaults to 0.1
    torch.testing.assert_close(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    ids = torch.tensor([[0, 14, 19], [8, 9, 10]])
    values = critic(input_ids=ids, attention_mask=(ids != 0).long()).logits
    assert values.shape == (2, 3, 1)


def test_reward_model_scores_the_last_token_whatever_the_padding(tmp_path: Path) -> None:
    model_dir = build_tiny_reward_model_dir(tmp_path / "rm", seed=1)
    rm = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert type(rm).__name__ == "LlamaForSequenceClassification" and rm.config.pad_token_id == 0
    left = torch.tensor([[0, 0, 19, 31, 14], [19, 31, 32, 41, 14]])
    with torch.no_grad():
        scores = rm(input_ids=left, attention_mask=(left != 0).long()).logits
        alone = rm(input_ids=left[:1, 2:]).logits
    assert scores.shape == (2, 1)
    torch.testing.assert_close(scores[:1], alone, rtol=0, atol=1e-5)
