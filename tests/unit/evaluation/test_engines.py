"""Evaluation decodes with an injected rollout engine; by default the one registered as the ``hf`` entry point."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_ops.evaluation.engines import ENGINE_GROUP, load_engine_factory
from rlhf_ops.evaluation.evaluator import EvalData, EvalSettings, evaluate_model
from tests.support.builders import write_toy_dataset
from workers.rollout.hf_rollout import HFRollout


def test_the_hf_entry_point_is_the_training_engine() -> None:
    assert load_engine_factory("hf") is HFRollout


def test_an_unregistered_engine_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=rf"no rollout engine 'sglang' in the entry-point group {ENGINE_GROUP}"):
        load_engine_factory("sglang")


def test_evaluate_model_decodes_with_the_injected_factory(tiny_model_dir: str, tmp_path: Any) -> None:
    built: list[dict[str, Any]] = []

    def factory(module: Any, **sampling: Any) -> HFRollout:  # the real engine, recording how it was built
        built.append(sampling)
        return HFRollout(module, **sampling)

    val = str(write_toy_dataset("copy_digit", tmp_path / "val.jsonl", num_rows=4, seed=3, chat=False))
    data = EvalData(files=[val], max_prompt_length=16, apply_chat_template=False)
    settings = EvalSettings(max_prompts=4, n_samples=2, max_new_tokens=2, seed=7)
    injected = evaluate_model(tiny_model_dir, data, reward_fn="copy_digit", settings=settings, engine_factory=factory)
    default = evaluate_model(tiny_model_dir, data, reward_fn="copy_digit", settings=settings)
    # one greedy pass and one sampled pass, each its own engine; same engine class, so the same report
    assert [b["do_sample"] for b in built] == [False, True] and all(b["response_length"] == 2 for b in built)
    assert injected["metrics"] == default["metrics"] and injected["examples"] == default["examples"]
