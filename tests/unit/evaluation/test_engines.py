"""Evaluation decodes through the rollout engine table, as training does: a throw-away engine from outside the
package, selected by dotted path or registered by name, is the one that decodes."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from rlhf_ops.evaluation.evaluator import EvalData, EvalSettings, evaluate_model
from rlhf_ops.extensions import ROLLOUT_ENGINES, RolloutEngineSpec
from rlhf_ops.pipeline.evaluate import eval_engine
from tests.support import extension_entries
from tests.support.builders import write_toy_dataset

_ENGINE = "tests.support.extension_entries:ENGINE"


@pytest.fixture(scope="module")
def val_data(tmp_path_factory: pytest.TempPathFactory) -> EvalData:
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    val = str(write_toy_dataset("copy_digit", path, num_rows=5, seed=3, chat=False))
    return EvalData(files=[val], max_prompt_length=16, apply_chat_template=False)


def _report(model: str, data: EvalData, engine: str) -> dict[str, Any]:
    settings = EvalSettings(max_prompts=5, n_samples=2, max_new_tokens=2, seed=7, batch_size=2, engine=engine)
    return evaluate_model(model, data, reward_fn="copy_digit", settings=settings)


def test_a_user_engine_by_dotted_path_decodes_the_evaluation(tiny_model_dir: str, val_data: EvalData) -> None:
    extension_entries.CALLS.clear()
    marked = _report(tiny_model_dir, val_data, _ENGINE)
    # one engine for both passes; 5 prompts in batches of 2 -> 3 calls greedy + 3 calls sampled
    assert extension_entries.CALLS["engine_built"] == 1 and extension_entries.CALLS["engine_calls"] == 6
    hf = _report(tiny_model_dir, val_data, "hf")  # the throw-away engine is the HF engine underneath
    assert marked["metrics"] == hf["metrics"] and marked["examples"] == hf["examples"]
    assert marked["settings"]["engine"] == _ENGINE


def test_a_registered_engine_is_selected_by_its_name(tiny_model_dir: str, val_data: EvalData) -> None:
    entry = RolloutEngineSpec(name="eval_marked", target=extension_entries.build_marked_hf_engine)
    ROLLOUT_ENGINES.register(entry)
    try:
        extension_entries.CALLS.clear()
        _report(tiny_model_dir, val_data, "eval_marked")
        assert extension_entries.CALLS["engine_built"] == 1
    finally:
        ROLLOUT_ENGINES.unregister("eval_marked")


def test_a_missing_package_is_refused_with_the_reason(tiny_model_dir: str, val_data: EvalData) -> None:
    entry = RolloutEngineSpec(name="needs_pkg", target="nowhere:build", package="no_such_package_rlhf")
    ROLLOUT_ENGINES.register(entry)
    try:
        with pytest.raises(ValueError, match="engine=needs_pkg: needs_pkg needs the Python package "):
            _report(tiny_model_dir, val_data, "needs_pkg")
        # the pipeline's evaluate task falls back to HF for it, as it does for vLLM where vLLM is missing
        assert eval_engine({"rollout": {"engine": "needs_pkg"}}) == "hf"
        assert eval_engine({"rollout": {"engine": "vllm"}}, "hf") == "hf"
    finally:
        ROLLOUT_ENGINES.unregister("needs_pkg")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_sglang_is_selectable_for_evaluation_and_refused_here_with_the_reason(
    tiny_model_dir: str, val_data: EvalData
) -> None:
    EvalSettings(engine="sglang")  # a valid value: the engine table's entry
    with pytest.raises(ValueError, match="engine=sglang: sglang needs the Python package 'sglang'") as info:
        _report(tiny_model_dir, val_data, "sglang")
    assert "has not run on this project's machines" in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_engine_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"engine='nope' is no rollout engine; set one of \['hf', 'vllm', 'sglang'"):
        EvalSettings(engine="nope")
    with pytest.raises(ValueError, match="eval_engine='nope' must be auto or one of"):
        eval_engine({"rollout": {"engine": "hf"}}, "nope")
