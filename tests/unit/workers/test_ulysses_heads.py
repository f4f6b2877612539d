"""Ulysses SP sizes are checked against the real model's head count before any forward."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tests.support.real_model import smollm2_path
from workers.sp.ulysses import check_ulysses_heads


def test_smollm2_heads_split_over_3_not_2() -> None:
    config = AutoConfig.from_pretrained(smollm2_path())  # 9 query heads, 3 kv heads (GQA)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    for ok in (1, 3, 9):
        check_ulysses_heads(config, ok)
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=2 does not divide the model's 9 attention"):
        check_ulysses_heads(config, 2)
    with pytest.raises(ValueError, match=r"set it to one of \[1, 3, 9\]"):
        check_ulysses_heads(config, 6)
