"""Values the config fuzzing of issue 15 found accepted: unsafe names, empty strings, any resume_mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_ops.config import ConfigError, load_config


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: str(p) for p in info.value.problems}


@pytest.mark.parametrize("key", ["trainer.run_name", "trainer.experiment_name"])
@pytest.mark.parametrize(
    "value",
    # YAML: '..' is literal, "..." has escapes (\0 = NUL, \t = tab)
    ["../../x", "a/b", "..", ".", ".hidden", "'a\\b'", '"a\\0b"', '"a\\tb"', "' padded'", "x" * 129, "''"],
)
def test_names_must_be_one_safe_path_component(key: str, value: str) -> None:
    problems = _problems([f"{key}={value}"])
    assert list(problems) == [key]
    assert "single folder name" in problems[key] and "Fix: use letters, digits" in problems[key]


@pytest.mark.parametrize("value", ["run-1", "grpo_2026.12.01", "a..b", "x" * 128, "Ünïcode"])
def test_safe_names_are_kept_as_written(value: str) -> None:
    run = load_config("tiny-cpu", [f"trainer.run_name={value}", f"trainer.experiment_name={value}"])
    assert run.trainer.run_name == value and run.trainer.experiment_name == value


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("reward.reward_fn", "null to score with reward.model_path"),
        ("tracking.mlflow_uri", "MLFLOW_TRACKING_URI"),
        ("trainer.remote_store_url", "null to keep checkpoints local only"),
        ("trainer.checkpoint_root", "set a folder"),
    ],
)
@pytest.mark.parametrize("value", ["", "'  '"])
def test_empty_strings_are_refused_where_null_is_meant(key: str, fix: str, value: str) -> None:
    problems = _problems([f"{key}={value}"])
    assert list(problems) == [key] and "is empty" in problems[key] and fix in problems[key]


def test_null_reward_fn_and_mlflow_uri_stay_allowed() -> None:
    run = load_config("tiny-cpu", ["tracking.mlflow_uri=null", "reward.model_path=/rm", "reward.reward_fn=null"])
    assert run.tracking.mlflow_uri is None and run.reward.reward_fn is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("whatever", "neither 'auto', 'disable', a URL nor an existing path"),
        ("Auto", "neither 'auto'"),  # case matters: the checkpoint manager compares exactly
        ("nosuch://host/ckpt", "not a checkpoint URL of a known scheme"),
        ("s3://", "not a checkpoint URL of a known scheme"),
        ("file:///nonexistent/global_step_3", "does not exist"),
        ("/nonexistent/global_step_3", "neither 'auto'"),
    ],
)
def test_resume_mode_must_name_a_mode_a_known_url_or_an_existing_path(value: str, message: str) -> None:
    problems = _problems([f"trainer.resume_mode={value}"])
    assert list(problems) == ["trainer.resume_mode"] and message in problems["trainer.resume_mode"]


def test_resume_mode_accepts_modes_urls_and_existing_paths(tmp_path: Path) -> None:
    ckpt = tmp_path / "global_step_2"
    ckpt.mkdir()
    for value in ["auto", "disable", str(ckpt), f"file://{ckpt}", "s3://bucket/exp/run/global_step_2"]:
        assert load_config("tiny-cpu", [f"trainer.resume_mode={value}"]).trainer.resume_mode == value


def test_resume_mode_accepts_any_protocol_fsspec_knows() -> None:
    # gs:// and memory:// are fsspec protocols beyond the four the storage layer configures itself.
    for value in ["gs://bucket/exp/run/global_step_2", "memory://exp/run/global_step_2"]:
        assert load_config("tiny-cpu", [f"trainer.resume_mode={value}"]).trainer.resume_mode == value


def test_config_show_refuses_an_unsafe_run_name_with_one_line() -> None:
    cmd = [sys.executable, "-m", "rlhf_ops.cli", "config", "show", "tiny-cpu", "trainer.run_name=../../x"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "trainer.run_name" in line]
    assert len(lines) == 1 and "'../../x'" in lines[0], proc.stderr
