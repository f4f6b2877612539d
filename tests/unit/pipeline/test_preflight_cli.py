"""`rlhf train`, `rlhf config show --check`, the Ray job entrypoint and the Airflow ``preflight`` task all stop
on pre-flight's problems: exit code 2 (or AirflowFailException), one line per problem, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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


def test_the_airflow_preflight_task_fails_cleanly_without_importing_torch(tmp_path: Path) -> None:
    train = tmp_path / "train.parquet"
    pd.DataFrame([{"prompt": "copy: 3", "ground_truth": "3", "data_source": "copy_digit"}]).to_parquet(train)
    prepared = {"train_url": str(train), "num_train": 64, "num_val": 0}
    params = {"work_dir": str(tmp_path / "work"), "overrides": ["reward.reward_fn=nope:fn"]}
    code = f"""
import json, logging, sys
from types import SimpleNamespace
from tests.support.airflow_env import configure_airflow_env
configure_airflow_env()
sys.path.append({str(ROOT / "dags")!r})
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from airflow.sdk.exceptions import AirflowFailException
from rlhf_airflow.pipeline import tasks
try:  # fetch_champion was skipped (warm_start scratch): its XCom is None
    tasks.preflight(json.loads({json.dumps(prepared)!r}), None, conns={{"s3_conn_id": None, "mlflow_conn_id": None}},
                    ray_conn_id="ray_default", params=json.loads({json.dumps(params)!r}),
                    override_policy={{"extra_allowed": ["reward.reward_fn"]}},  # a spec that lets the form set it
                    dag=SimpleNamespace(dag_id="d"), run_id="manual__1")
except AirflowFailException as exc:
    print("FAILED:", str(exc).splitlines()[0])
warm = {{**json.loads({json.dumps(params)!r}), "warm_start": "champion", "overrides": []}}
try:  # fetch_champion's result: its model folder becomes model.path (here one that is not there)
    tasks.preflight(json.loads({json.dumps(prepared)!r}), {{"model_dir": {str(tmp_path / "champion")!r}}},
                    conns={{"s3_conn_id": None, "mlflow_conn_id": None}}, ray_conn_id="ray_default", params=warm,
                    dag=SimpleNamespace(dag_id="d"), run_id="manual__1")
except AirflowFailException as exc:
    print("FAILED2:", [line for line in str(exc).splitlines() if "model.path" in line])
print("torch imported:", "torch" in sys.modules)
"""
    proc, _ = _run("-c", code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    logged = [line for line in lines if "error: reward.reward_fn" in line]  # structlog decorates the line
    assert len(logged) == 1, proc.stdout
    assert (
        "error: reward.reward_fn: reward function 'nope:fn': cannot import module 'nope' (No module named 'nope'). "
        "Fix: install the package or put it on PYTHONPATH of every worker, or fix the spelling "
        "('package.module:function')" in logged[0]
    )
    assert "FAILED: preflight found 1 problem(s); nothing was started:" in lines
    (warm,) = [line for line in lines if line.startswith("FAILED2:")]
    assert f"model.path: {tmp_path / 'champion'}" in warm, warm
    assert lines[-1] == "torch imported: False"


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
