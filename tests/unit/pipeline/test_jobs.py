"""The heavy jobs' channel: typed, versioned requests; results through the remote store or a tagged log line (never a
shared folder); user mistakes, unknown versions and shipped code that does not import as one non-retryable line."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from rlhf_ops.pipeline.heavy.prepare_data import PrepareDataRequest
from rlhf_ops.pipeline.job_requests import PIPELINE_JOBS, RunRef, parse_request
from rlhf_ops.pipeline.job_results import (
    current_submission_id,
    job_entrypoint,
    read_result,
    result_from_logs,
    result_line,
    result_url,
)
from rlhf_ops.pipeline.jobs import run_job
from rlhf_ops.pipeline.params import PipelineParams


def _request(tmp_path: Path, *, remote: str | None = None, **params: object) -> PrepareDataRequest:
    run = RunRef(dag_id="d", run_id="manual__1", work_dir=str(tmp_path / "ray"), remote_store_url=remote)
    return PrepareDataRequest(run=run, params=PipelineParams(**params).model_dump(mode="json"))


def test_entrypoint_names_a_job_of_the_table() -> None:
    assert shlex.split(job_entrypoint("evaluate")) == ["python", "-m", "rlhf_ops.cli", "pipeline-job", "evaluate"]
    with pytest.raises(ValueError, match=r"job='train' is not a registered pipeline job; set one of \['"):
        job_entrypoint("train")
    # the built-ins are the modules of rlhf_ops.pipeline.heavy, found without a list anywhere
    assert sorted(PIPELINE_JOBS.builtin_names()) == sorted(
        ["prepare_data", "fetch_champion", "preflight", "evaluate", "retain", "register"]
    )
    for entry in PIPELINE_JOBS:  # each body is the decorated function of its module
        assert entry.load().__module__ == f"rlhf_ops.pipeline.heavy.{entry.name}", entry
        assert entry.load().pipeline_job is entry


def test_submission_id_follows_the_hooks_retry_naming() -> None:
    assert current_submission_id({"RLHF_SUBMISSION_ID": "af-d-r-t-0123456789"}) == "af-d-r-t-0123456789"
    retried = {"RLHF_SUBMISSION_ID": "af-d-r-t-0123456789", "RLHF_RETRY_INDEX": "2"}
    assert current_submission_id(retried) == "af-d-r-t-0123456789-retry2"  # RayJobHook.submit's -retry<N>
    with pytest.raises(ValueError, match=r"\$RLHF_SUBMISSION_ID is not set"):
        current_submission_id({})


def test_request_round_trips_and_an_unknown_version_or_field_is_one_line(tmp_path: Path) -> None:
    request = _request(tmp_path)
    assert parse_request("prepare_data", request.model_dump_json()) == request
    newer = {**json.loads(request.model_dump_json()), "schema_version": 2}
    with pytest.raises(
        ValueError, match=r"schema_version=2 but this rlhf-ops reads 1: install the same rlhf-ops"
    ) as e:
        parse_request("prepare_data", json.dumps(newer))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"schema_version=None"):  # a request from before versions existed
        parse_request("prepare_data", json.dumps({"params": {}, "layout": {}}))
    broken = {**json.loads(request.model_dump_json()), "paramz": {}}
    with pytest.raises(ValueError, match=r"field 'paramz': Extra inputs are not permitted"):
        parse_request("prepare_data", json.dumps(broken))


def test_result_line_is_found_only_for_its_own_submission() -> None:
    logs = "\n".join(
        [
            "loading...",
            result_line("af-1", {"status": "ok", "value": {"n": 1}}),
            'RLHF_JOB_RESULT af-1-retry1 {"status": "ok", "value": {"n": 2}}',  # another attempt's line
            "print('RLHF_JOB_RESULT af-1 ...') from user code is not at the start of a line",
            "done",
        ]
    )
    assert result_from_logs(logs, "af-1") == {"status": "ok", "value": {"n": 1}}
    assert result_from_logs(logs, "af-2") is None
    assert read_result("af-1", remote_run_url=None, logs=lambda: logs) == {"status": "ok", "value": {"n": 1}}


def test_a_refused_override_is_a_non_retryable_error_on_the_remote_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = (tmp_path / "store").as_uri()
    request = _request(tmp_path, remote=remote, overrides=["data.train_files=[/etc/passwd]"])
    env = {"RLHF_SUBMISSION_ID": "af-1", "RLHF_RETRY_INDEX": "1", "RLHF_JOB_REQUEST": request.model_dump_json()}
    assert run_job("prepare_data", environ=env) == 2
    run_url = request.run.remote_run_url
    assert run_url is not None
    result = read_result("af-1-retry1", remote_run_url=run_url, logs=lambda: "")
    assert result is not None and (result["status"], result["retryable"]) == ("error", False)
    assert "'data.train_files' may not be set from this pipeline's trigger form" in result["error"]
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert read_result("af-1", remote_run_url=run_url, logs=lambda: "") is None  # another attempt's result
    assert Path(result_url(run_url, "af-1-retry1").removeprefix("file://")).is_file()
    assert not (tmp_path / "ray").exists()  # refused before the job touched its work folder


def test_without_a_remote_store_the_result_is_the_tagged_log_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer = {**json.loads(_request(tmp_path).model_dump_json()), "schema_version": 7}
    env = {"RLHF_SUBMISSION_ID": "af-2", "RLHF_JOB_REQUEST": json.dumps(newer)}
    assert run_job("prepare_data", environ=env) == 2
    out = capsys.readouterr()
    result = result_from_logs(out.out, "af-2")
    assert result is not None and result["retryable"] is False and "schema_version=7" in result["error"]
    assert out.err.count("\n") == 1


def test_shipped_code_that_does_not_import_is_one_line_at_job_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "team_reward_broken.py").write_text("import package_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # where Ray puts py_modules
    env = {
        "RLHF_SUBMISSION_ID": "af-3",
        "RLHF_JOB_REQUEST": _request(tmp_path).model_dump_json(),
        "RLHF_SHIPPED_MODULES": "team_reward_broken",
    }
    assert run_job("prepare_data", environ=env) == 2
    out = capsys.readouterr()
    assert out.err == (
        "error: shipped module 'team_reward_broken' does not import (ModuleNotFoundError: No module named "
        "'package_that_is_not_installed'); fix the module, or add the package it needs to the run's code.pip\n"
    )
    assert not (tmp_path / "ray").exists()  # nothing ran
