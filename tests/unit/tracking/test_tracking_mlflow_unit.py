"""Parts of the MLflow integration that need no server: names, tags, commit lookup, rank gating, input checks."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
from pathlib import Path

import pytest

import rlhf_ops
from rlhf_ops.tracking import mlflow_tracking as mt

UNREACHABLE = "http://127.0.0.1:9"  # discard port: any request would fail, so passing tests made none


def test_run_name_for_naive_and_aware_dates() -> None:
    assert (
        mt.run_name_for("tiny-cpu", "grpo", dt.datetime(2026, 11, 29, 10, 0, 59)) == "tiny-cpu/grpo/2026-11-29T10:00"
    )
    cet = dt.timezone(dt.timedelta(hours=1))
    # 11:30 at UTC+1 is 10:30 UTC.
    assert (
        mt.run_name_for("gpu-7b", "ppo", dt.datetime(2026, 11, 29, 11, 30, tzinfo=cet))
        == "gpu-7b/ppo/2026-11-29T10:30"
    )
    # two runs started in the same minute: told apart by the key
    assert mt.run_name_for("tiny-cpu", "grpo", dt.datetime(2026, 11, 29, 10, 0), key="1a2b3c4d") == (
        "tiny-cpu/grpo/2026-11-29T10:00/1a2b3c4d"
    )


def test_pipeline_tags() -> None:
    assert mt.pipeline_tags(dag_id="rlhf_ppo", dag_run_id="manual__1", try_number=2, ray_submission_id="rlhf-1") == {
        "airflow.dag_id": "rlhf_ppo",
        "airflow.run_id": "manual__1",
        "airflow.try_number": "2",
        "ray.submission_id": "rlhf-1",
    }
    assert "ray.submission_id" not in mt.pipeline_tags(dag_id="d", dag_run_id="r", try_number=1)


def test_platform_git_commit_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mt.ENV_GIT_COMMIT, "abc123")
    assert mt.platform_git_commit() == "abc123"


def test_platform_git_commit_from_the_source_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mt.ENV_GIT_COMMIT, raising=False)
    pkg = Path(rlhf_ops.__file__).parent
    tracked = subprocess.run(
        ["git", "-C", str(pkg), "ls-files", "--error-unmatch", "__init__.py"], capture_output=True
    )
    head = subprocess.run(["git", "-C", str(pkg), "rev-parse", "--verify", "HEAD"], capture_output=True, text=True)
    commit = mt.platform_git_commit()
    if tracked.returncode == 0 and head.returncode == 0:
        assert re.fullmatch(r"[0-9a-f]{40}", commit) and commit == head.stdout.strip()
    else:
        assert commit == "unknown"


def test_non_zero_rank_logger_is_a_no_op_without_run_or_server(tmp_path: Path) -> None:
    logger = mt.MlflowLogger(None, tracking_uri=UNREACHABLE, rank=1)
    assert not logger.active
    logger.log_metrics({"actor/pg_loss": 1.0}, step=1)
    logger.log_params({"a": 1})
    logger.log_dict({"a": 1}, "a.json")
    logger.log_table([{"a": 1}], "t.json")
    logger.set_tags({"a": "b"})
    (tmp_path / "config.json").write_text("{}")
    assert logger.log_model_dir(tmp_path) is None
    logger.close()


def test_rank_zero_logger_needs_a_run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mt.ENV_RUN_ID, raising=False)
    with pytest.raises(ValueError, match=r"no run id; pass run_id= or set \$MLFLOW_RUN_ID"):
        mt.MlflowLogger(tracking_uri=UNREACHABLE)


def test_input_errors_name_the_field(tmp_path: Path) -> None:
    logger = mt.MlflowLogger("r", tracking_uri=UNREACHABLE, rank=3)
    with pytest.raises(ValueError, match="log_table: artifact_file must end in .json"):
        logger.log_table([{"a": 1}], "t.csv")
    with pytest.raises(ValueError, match="hf_dir .* is not a folder"):
        logger.log_model_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="status must be FINISHED, FAILED or KILLED"):
        mt.end_pipeline_run(tracking_uri=UNREACHABLE, run_id="r", status="DONE")
