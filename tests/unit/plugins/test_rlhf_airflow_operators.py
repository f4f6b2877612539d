"""RayJobOperator: submission-id derivation, execute_complete event validation, template fields (no Ray)."""

from __future__ import annotations

import re
import socket
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException

from rlhf_airflow.operators import MAX_SUBMISSION_ID_LEN, RayJobOperator, derive_submission_id

_RUN_ID = "manual__2025-01-01T00:00:00+00:00"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _operator(**kwargs: Any) -> RayJobOperator:
    return RayJobOperator(task_id="train", entrypoint="python -m rlhf_ops.cli train", ray_conn_id="ray_test", **kwargs)


def test_submission_id_is_stable_readable_and_sanitised() -> None:
    first = derive_submission_id(dag_id="rlhf_ppo", run_id=_RUN_ID, task_id="train")
    again = derive_submission_id(dag_id="rlhf_ppo", run_id=_RUN_ID, task_id="train")
    assert first == again  # same task instance → same id on every try (try_number is not an input)
    # ":" and "+" become "-"; runs of unsafe characters collapse into one "-".
    assert re.fullmatch(r"af-rlhf_ppo-manual__2025-01-01T00-00-00-00-00-train-[0-9a-f]{10}", first), first
    assert re.fullmatch(r"[A-Za-z0-9_-]+", first)


def test_submission_id_distinguishes_what_sanitising_merges() -> None:
    a = derive_submission_id(dag_id="d", run_id="r:1", task_id="t")
    b = derive_submission_id(dag_id="d", run_id="r+1", task_id="t")
    assert a[:-10] == b[:-10] == "af-d-r-1-t-"  # same readable part...
    assert a != b  # ...but different digests of the raw identity
    mapped = [derive_submission_id(dag_id="d", run_id="r", task_id="t", map_index=i) for i in (-1, 0, 1)]
    assert len(set(mapped)) == 3 and "-t-0-" in mapped[1]


def test_submission_id_is_capped_for_long_ids() -> None:
    long_id = derive_submission_id(dag_id="d" * 300, run_id="scheduled__" + "x" * 300, task_id="t" * 250)
    assert len(long_id) <= MAX_SUBMISSION_ID_LEN == 100
    assert re.fullmatch(r"af-d+-[0-9a-f]{10}", long_id), long_id  # 300 "d"s fill the readable budget


def test_explicit_submission_id_is_validated() -> None:
    assert _operator(submission_id="my-job_1").resolve_submission_id({}) == "my-job_1"
    with pytest.raises(ValueError, match="submission_id='bad id/1' must match"):
        _operator(submission_id="bad id/1").resolve_submission_id({})


def test_execute_complete_returns_submission_id_on_success() -> None:
    event = {"status": "success", "submission_id": "s-1", "job_status": "SUCCEEDED", "message": "", "log_tail": ""}
    assert _operator().execute_complete({}, event) == "s-1"


def test_execute_complete_raises_with_status_and_log_tail_on_error() -> None:
    event = {
        "status": "error",
        "submission_id": "s-2",
        "job_status": "FAILED",
        "message": "Job entrypoint command failed with exit code 3",
        "log_tail": "step 9\nValueError: actor.optim.lr must be > 0",
    }
    with pytest.raises(AirflowException) as info:
        _operator().execute_complete({}, event)
    text = str(info.value)
    assert "Ray job s-2 error: status=FAILED" in text
    assert "exit code 3" in text
    assert text.endswith("--- last log lines ---\nstep 9\nValueError: actor.optim.lr must be > 0")


def test_execute_complete_timeout_tries_to_stop_then_raises() -> None:
    # The cluster is unreachable: stopping fails quietly (logged) and the timeout still fails the task.
    op = _operator(ray_address=f"http://127.0.0.1:{_closed_port()}")
    event = {"status": "timeout", "submission_id": "s-3", "job_status": "RUNNING", "message": "m", "log_tail": "t"}
    with pytest.raises(AirflowException, match="Ray job s-3 timeout: status=RUNNING"):
        op.execute_complete({}, event)


@pytest.mark.parametrize("event", [None, {}, {"status": "success"}, "success"])
def test_execute_complete_rejects_malformed_events(event: Any) -> None:
    with pytest.raises(AirflowException, match="malformed event"):
        _operator().execute_complete({}, event)


def test_init_only_stores_arguments_and_declares_template_fields() -> None:
    op = _operator(env_vars={"A": "{{ run_id }}"}, ray_address="{{ params.ray_address }}", poll_interval=1)
    assert set(RayJobOperator.template_fields) == {"entrypoint", "env_vars", "ray_address", "runtime_env"}
    assert op.env_vars == {"A": "{{ run_id }}"} and op.ray_address == "{{ params.ray_address }}"
    assert op.deferrable is True and op.wait_for_completion is True and op.submission_id is None
    assert [link.name for link in op.operator_extra_links] == ["Ray job", "MLflow run", "Checkpoints"]
    op.on_kill()  # nothing submitted yet: no-op, no connection lookup
