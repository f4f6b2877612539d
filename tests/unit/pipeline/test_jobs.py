"""The heavy tasks' Ray job protocol: entrypoint, result file keyed by submission id, user mistakes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from rlhf_ops.pipeline.job_results import current_submission_id, job_entrypoint, read_result, result_path
from rlhf_ops.pipeline.jobs import run_job
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.params import PipelineParams


def test_entrypoint_is_the_cli_with_a_quoted_result_dir() -> None:
    command = job_entrypoint("evaluate", "/shared/jobs/my dag/run 1")
    assert shlex.split(command) == [
        "python", "-m", "rlhf_ops.cli", "pipeline-job", "evaluate", "--result-dir", "/shared/jobs/my dag/run 1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"job 'train' is not a pipeline job; choose one of \['prepare_data'"):
        job_entrypoint("train", "/x")


def test_submission_id_follows_the_hooks_retry_naming() -> None:
    assert current_submission_id({"RLHF_SUBMISSION_ID": "af-d-r-t-0123456789"}) == "af-d-r-t-0123456789"
    retried = {"RLHF_SUBMISSION_ID": "af-d-r-t-0123456789", "RLHF_RETRY_INDEX": "2"}
    assert current_submission_id(retried) == "af-d-r-t-0123456789-retry2"  # RayJobHook.submit's -retry<N>
    with pytest.raises(ValueError, match=r"\$RLHF_SUBMISSION_ID is not set"):
        current_submission_id({})


def test_a_refused_override_is_a_non_retryable_error_in_the_result_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = RunLayout.for_run(dag_id="d", run_id="manual__1", work_dir=str(tmp_path))
    params = PipelineParams(overrides=["data.train_files=[/etc/passwd]"])
    request = {"params": params.model_dump(mode="json"), "layout": layout.to_dict(), "override_policy": {}}
    env = {"RLHF_SUBMISSION_ID": "af-1", "RLHF_RETRY_INDEX": "1", "RLHF_JOB_REQUEST": json.dumps(request)}
    assert run_job("prepare_data", result_dir=layout.jobs_dir, environ=env) == 2
    result = read_result(layout.jobs_dir, "af-1-retry1")
    assert result is not None and (result["status"], result["retryable"]) == ("error", False)
    assert "'data.train_files' may not be set from this pipeline's trigger form" in result["error"]
    assert capsys.readouterr().err.startswith("error: ")
    assert read_result(layout.jobs_dir, "af-1") is None  # another attempt's result is another file
    assert result_path(layout.jobs_dir, "af-1-retry1").parent == tmp_path / "jobs" / "d" / layout.run_key
    assert not list(tmp_path.rglob("*.parquet"))  # refused before anything was read
