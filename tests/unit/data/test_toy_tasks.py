"""Built-in toy datasets: row format, determinism, ground truths, tokenizer coverage."""

from __future__ import annotations

import pytest

from rlhf_ops.data.toy_tasks import TOY_TASKS, make_toy_dataset
from rlhf_ops.models.tiny import ALPHABET


def test_copy_digit_rows_hold_the_digit_as_ground_truth() -> None:
    rows = make_toy_dataset("copy_digit", num_rows=50, seed=0)
    for row in rows:
        assert set(row) == {"prompt", "ground_truth", "data_source"}
        assert row["data_source"] == "toy/copy_digit"
        [message] = row["prompt"]
        assert message["role"] == "user" and message["content"] == f"copy: {row['ground_truth']}"
        assert row["ground_truth"] in "0123456789" and len(row["ground_truth"]) == 1
    assert len({r["ground_truth"] for r in rows}) == 10  # 50 uniform draws cover all 10 digits with this seed


def test_add_digits_ground_truth_is_the_sum() -> None:
    rows = make_toy_dataset("add_digits", num_rows=40, seed=1, chat=False)
    for row in rows:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["ground_truth"] == str(int(a) + int(b)) and row["data_source"] == "toy/add_digits"
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9


def test_rows_are_deterministic_in_the_seed() -> None:
    for name in TOY_TASKS:
        assert make_toy_dataset(name, num_rows=20, seed=5) == make_toy_dataset(name, num_rows=20, seed=5)
        assert make_toy_dataset(name, num_rows=20, seed=5) != make_toy_dataset(name, num_rows=20, seed=6)


def test_every_character_is_in_the_tiny_tokenizer_alphabet() -> None:
    for name in TOY_TASKS:
        for row in make_toy_dataset(name, num_rows=30, seed=0, chat=False):
            assert set(row["prompt"]) <= set(ALPHABET) and set(row["ground_truth"]) <= set(ALPHABET)


def test_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match="name='nope'.*choose one of"):
        make_toy_dataset("nope", num_rows=1, seed=0)
    with pytest.raises(ValueError, match="num_rows=0 must be >= 1"):
        make_toy_dataset("copy_digit", num_rows=0, seed=0)
