"""`rlhf train`, `rlhf config show --check`, the Ray job entrypoint and the Airflow ``preflight`` task all stop
on pre-flight's problems: exit code 2 (or AirflowFailException), one line per problem, no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_rlhf_train_with_an_unimportable_reward_stops_before_anything_starts(tmp_path: Path) -> None:
    proc, seconds = _run("-m", "rlhf_ops.cli", "train", "reward.reward_fn=nope:fn", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert seconds < 20, seconds  # measured ~1.5 s idle; no torch, no Ray
    assert "Traceback" not in proc.stderr + proc.stdout
    assert _error_lines(proc.stderr) == [
        "error: reward.reward_fn: reward function 'nope:fn': cannot import module 'nope' (No module named 'nope'). "
        "Fix: install the package or put it on PYTHONPATH of every worker, or fix the spelling "
        "('package.module:function')"
    ]
    assert not (tmp_path / "checkpoints").exists()  # the run folder is made after pre-flight only


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.train_files=[/nonexistent.jsonl]", "data.train_files"),
        ("trainer.run_name=../../x", "trainer.run_name"),
        ("trainer.resume_mode=typo", "trainer.resume_mode"),
    ],
)
def test_rlhf_train_names_the_key_of_each_bad_input(tmp_path: Path, override: str, key: str) -> None:
    proc, _ = _run("-m", "rlhf_ops.cli", "train", override, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if key in line] != [], proc.stderr
    assert len([line for line in proc.stderr.splitlines() if key in line]) == 1, proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_the_ray_job_entrypoint_runs_the_same_preflight(tmp_path: Path) -> None:
    proc, _ = _run("-m", "workers.entrypoints.train", "--preset", "tiny-cpu", "reward.reward_fn=nope:fn", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line.split(":")[1] for line in _error_lines(proc.stderr)] == [" reward.reward_fn"]


def test_config_show_check(tmp_path: Path) -> None:
    ok, _ = _run("-m", "rlhf_ops.cli", "config", "show", "tiny-cpu", "--check", cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.strip() == "preflight ok: the run can start", ok.stderr
    bad, _ = _run(
        "-m", "rlhf_ops.cli", "config", "show", "tiny-cpu", "reward.reward_fn=nope:fn",
        "data.train_files=[/nonexistent.jsonl]", "--check", cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert [line.split(":")[1].strip() for line in _error_lines(bad.stderr)] == [
        "data.train_files",
        "reward.reward_fn",
    ]


def test_the_preflight_job_fails_in_one_line_per_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlhf_ops.pipeline.heavy.preflight import PreflightRequest
    from rlhf_ops.pipeline.job_requests import RunRef
    from rlhf_ops.pipeline.job_results import result_from_logs
    from rlhf_ops.pipeline.jobs import run_job
    from rlhf_ops.pipeline.params import PipelineParams

    train = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": "copy: 3", "ground_truth": "3", "data_source": "copy_digit"}]).to_parquet(train)
    prepared = {"train_url": str(train), "num_train": 64, "num_val": 0}
    run = RunRef(dag_id="d", run_id="manual__1", work_dir=str(tmp_path / "work"))

    def job(sid: str, **fields: Any) -> str:
        request = PreflightRequest(run=run, prepared=prepared, **fields)
        assert (
            run_job("preflight", environ={"RLHF_SUBMISSION_ID": sid, "RLHF_JOB_REQUEST": request.model_dump_json()})
            == 2
        )
        out = capsys.readouterr()
        result = result_from_logs(out.out, sid)
        assert result is not None and result["retryable"] is False and out.err.count("\n") == 1
        return str(result["error"])

    # A spec that lets the form set reward.reward_fn; fetch_champion was skipped (warm_start scratch).
    params = PipelineParams(overrides=["reward.reward_fn=nope:fn"]).model_dump(mode="json")
    error = job("af-1", params=params, override_policy={"extra_allowed": ["reward.reward_fn"]})
    assert error == (
        "reward.reward_fn: reward function 'nope:fn': cannot import module 'nope' (No module named 'nope'). "
        "Fix: install the package or put it on PYTHONPATH of every worker, or fix the spelling "
        "('package.module:function')"
    )
    # fetch_champion's result: its model folder becomes model.path (here one that is not there)
    warm = PipelineParams(warm_start="champion").model_dump(mode="json")
    error = job("af-2", params=warm, model_path=str(tmp_path / "champion"))
    assert f"model.path: {tmp_path / 'champion'}" in error, error


def test_the_resume_mode_from_the_operator_is_validated_like_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhf_ops.config import ConfigError, load_config
    from rlhf_ops.pipeline.preflight import checked_config

    config = load_config("tiny-cpu")
    monkeypatch.setenv("RLHF_RESUME_MODE", "disable")
    assert checked_config(config).trainer.resume_mode == "disable"
    monkeypatch.setenv("RLHF_RESUME_MODE", "typo")
    with pytest.raises(ConfigError) as caught:
        checked_config(config)
    assert [p.key for p in caught.value.problems] == ["trainer.resume_mode"]


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b-grpo-gpu", "qwen2.5-7b-ppo-gpu"])
def test_gpu_presets_away_from_their_cluster_fail_with_lines_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preset: str
) -> None:
    # here: no /models folder and no S3 credentials (botocore's NoCredentialsError is not an OSError)
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    proc, _ = _run("-m", "rlhf_ops.cli", "config", "show", preset, "--check", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    keys = [line.split(":")[1].strip() for line in proc.stderr.splitlines()]
    assert keys == ["model.path", "data.train_files", "data.val_files", "trainer.remote_store_url"], proc.stderr
