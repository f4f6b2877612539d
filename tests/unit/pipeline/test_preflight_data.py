"""prepare_data's reading of the (unvalidated) config, and preflight's reachability checks."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from rlhf_ops.pipeline.data import data_settings
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.params import PipelineParams
from rlhf_ops.pipeline.preflight import PreflightError, run_preflight


def test_data_settings_default_to_the_preset() -> None:
    settings = data_settings(PipelineParams(preset="tiny-cpu"))
    assert (settings["source"], settings["val_source"]) == ("builtin:copy_digit", "builtin:copy_digit")
    assert settings["tokenizer"] == "builtin:tiny-llama"
    assert settings["max_prompt_length"] == 16 and settings["apply_chat_template"] is False


def test_data_settings_follow_the_form_and_overrides() -> None:
    params = PipelineParams(
        dataset_url="s3://raw/rows.jsonl", model_path="/models/m", overrides=["data.max_prompt_length=256"]
    )
    settings = data_settings(params)
    assert settings["source"] == "s3://raw/rows.jsonl"
    assert settings["val_source"] is None  # a user's dataset is split, not validated on the toy set
    assert settings["tokenizer"] == "/models/m" and settings["max_prompt_length"] == 256


def test_data_settings_need_one_source() -> None:
    with pytest.raises(ValueError, match="2 data.train_files; set dataset_url"):
        data_settings(PipelineParams(overrides=["data.train_files=[a.jsonl, b.jsonl]"]))


def test_preflight_names_every_unreachable_input(tmp_path: Path) -> None:
    layout = RunLayout.for_run(dag_id="d", run_id="r", work_dir=str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()  # a folder without config.json or tokenizer files
    prepared = {"train_url": str(tmp_path / "missing" / "train.parquet"), "num_train": 0, "num_val": 0}
    with pytest.raises(PreflightError) as caught:
        run_preflight(PipelineParams(model_path=str(model)), layout, prepared)
    problems = [str(p) for p in caught.value.problems]
    assert any(p.startswith("model.path: ") and "has no config.json" in p for p in problems), problems
    assert any(p.startswith("data: the prepared training set is empty") for p in problems), problems
    assert any(p.startswith("data.train_files: ") and "does not exist" in p for p in problems), problems


def test_preflight_plan(tmp_path: Path) -> None:
    train = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": "copy: 3", "ground_truth": "3", "data_source": "copy_digit"}]).to_parquet(train)
    layout = RunLayout.for_run(
        dag_id="d", run_id="r", work_dir=str(tmp_path), remote_store_url=f"file://{tmp_path}/rs"
    )
    params = PipelineParams(total_training_steps=7, save_freq=3, overrides=["trainer.total_epochs=1"])
    plan = run_preflight(params, layout, {"train_url": str(train), "num_train": 160, "num_val": 0})
    assert plan["total_steps"] == 7 and plan["checkpoint_steps"] == [3, 6, 7]  # 160 // 16 = 10 per epoch, cap 7
    assert plan["entrypoint"].startswith("python -m workers.entrypoints.train --preset tiny-cpu ")
    assert plan["registered_model_name"] == "d-tiny-cpu"
    assert plan["checkpoint_url"] == f"file://{tmp_path}/rs/d/{layout.run_key}"
    assert not list((tmp_path / "rs").rglob(".preflight-*"))  # the store probe cleaned up after itself
