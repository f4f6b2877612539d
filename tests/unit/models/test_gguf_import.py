"""GGUF import: the real model's HF directory loads as a plain checkpoint and matches the GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_ops.cli import main as cli_main
from rlhf_ops.models.gguf import IMPORT_RECORD, SMOLLM2_GGUF, import_gguf
from rlhf_ops.models.resolve import cache_dir, resolve_model_path
from tests.support.real_model import smollm2_path


def test_smollm2_directory_is_a_plain_bf16_checkpoint_with_tied_embeddings_and_chat_template() -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    path = Path(smollm2_path())
    config = AutoConfig.from_pretrained(path)
    assert getattr(config, "quantization_config", None) is None
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert config.num_key_value_heads == 3 and config.vocab_size == 49152 and config.tie_word_embeddings
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys  # tied: stored once
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.pad_token_id == tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert json.loads((path / IMPORT_RECORD).read_text())["dtype"] == "bfloat16"
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow  # writes and reads back a GGUF of the 135M model (~35 s here)
def test_imported_logits_equal_the_gguf_loaded_model(tmp_path: Path) -> None:
    """fp32 import == transformers' own GGUF de-quantisation, token for token (atol 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smollm2_path()  # builds the cache, including the GGUF file
    gguf = cache_dir() / "gguf" / SMOLLM2_GGUF
    out = import_gguf(gguf, tmp_path / "fp32", dtype="float32")
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_import_refuses_bad_input_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04junk")
    assert cli_main(["model", "import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 2
    assert cli_main(["model", "import-gguf", str(not_gguf), str(tmp_path / "o")]) == 2
    assert cli_main(["model", "import-gguf", str(not_gguf), str(tmp_path / "o"), "--dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "does not exist" in err[0] and "not a GGUF file" in err[1] and "--dtype" in err[2]
    assert not (tmp_path / "o").exists()


def test_unknown_builtin_model_names_the_choices() -> None:
    with pytest.raises(ValueError, match="builtin:smollm2-135m-instruct"):
        resolve_model_path("builtin:nope")
