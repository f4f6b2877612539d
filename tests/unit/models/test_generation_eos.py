"""``eos_token_ids``: the tokenizer's EOS plus every id of ``generation_config.json`` (hand-written files)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_ops.models.generation import eos_token_ids

TOKENIZER = SimpleNamespace(eos_token_id=2)


def _write(tmp_path: Path, content: object) -> Path:
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


def test_generation_config_list_is_merged_after_the_tokenizer_eos(tmp_path: Path) -> None:
    # Llama-3-style list [128001, 2, 128009]: the tokenizer's 2 first, the duplicate dropped, order kept.
    model_dir = _write(tmp_path, {"eos_token_id": [128001, 2, 128009], "bos_token_id": 1})
    assert eos_token_ids(model_dir, TOKENIZER) == [2, 128001, 128009]


def test_single_int_missing_key_and_missing_file(tmp_path: Path) -> None:
    assert eos_token_ids(_write(tmp_path, {"eos_token_id": 2}), TOKENIZER) == [2]  # SmolLM2: one id
    assert eos_token_ids(_write(tmp_path, {"eos_token_id": 7}), TOKENIZER) == [2, 7]
    assert eos_token_ids(_write(tmp_path, {"bos_token_id": 1}), TOKENIZER) == [2]
    assert eos_token_ids(tmp_path / "nowhere", TOKENIZER) == [2]
    assert eos_token_ids(None, TOKENIZER) == [2]
    # A tokenizer without EOS (some base models) takes the generation config's.
    assert eos_token_ids(_write(tmp_path, {"eos_token_id": [5, 6]}), SimpleNamespace(eos_token_id=None)) == [5, 6]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "is not a JSON object"),
        ('["a list"]', "is not a JSON object"),
        ({"eos_token_id": "</s>"}, "eos_token_id='</s>'; it must be an int or a list of ints"),
        ({"eos_token_id": [2, "x"]}, "it must be an int or a list of ints"),
    ],
)
def test_bad_generation_config_names_the_key_and_the_fix(tmp_path: Path, content: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        eos_token_ids(_write(tmp_path, content), TOKENIZER)
    assert str(err.value).startswith("model.path: ")


def test_no_eos_anywhere_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="defines an EOS token; set eos_token in the tokenizer config"):
        eos_token_ids(_write(tmp_path, {}), SimpleNamespace(eos_token_id=None))
