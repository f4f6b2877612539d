"""A Ray job that ends preempted (exit code 75, what ``rlhf train`` returns after checkpointing on SIGTERM) is
resubmitted with resume by ``RayJobOperator`` within the same try; any other failure still fails the task."""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env

configure_airflow_env()  # before anything imports airflow

from typing import Any  # noqa: E402

import pytest  # noqa: E402

from rlhf_airflow.hooks import RayJobHook  # noqa: E402
from rlhf_airflow.operators import RayJobOperator, derive_submission_id  # noqa: E402
from rlhf_ops.trainer.faults import EXIT_PREEMPTED  # noqa: E402
from tests.integration import test_ray_job_operator as operator_tests  # noqa: E402
from tests.integration.test_ray_job_operator import CONN_ID, _TaskInstance, _unique  # noqa: E402

ray_head = operator_tests.ray_head  # the module's private Ray head (token auth), shared by these tests

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Preempted (exit 75) on its first run; a resubmitted run gets RLHF_RESUME_MODE=auto and succeeds.
ENTRY = (
    "python -c \"import os, sys; resumed = os.environ.get('RLHF_RESUME_MODE') == 'auto'; "
    "print('resumed' if resumed else 'rlhf: preempted at step 1 of 4', flush=True); "
    'sys.exit(0 if resumed else {code})"'
)


def _operator(run_id: str, code: int) -> tuple[RayJobOperator, Any, str]:
    op = RayJobOperator(
        task_id="train",
        entrypoint=ENTRY.format(code=code),
        ray_conn_id=CONN_ID,
        deferrable=False,
        poll_interval=0.3,
        retries=0,
    )
    ti = _TaskInstance(dag_id="it_preempt", run_id=run_id, task_id="train")
    return op, {"ti": ti}, derive_submission_id(dag_id="it_preempt", run_id=run_id, task_id="train")


def test_a_preempted_job_is_resubmitted_with_resume_in_the_same_try(ray_head: str) -> None:
    op, context, base = _operator(_unique("preempt"), EXIT_PREEMPTED)
    assert op.execute(context) == f"{base}-retry1"  # no AirflowException: the try did not fail
    hook = RayJobHook(CONN_ID)
    assert hook.status(base) == "FAILED" and hook.status(f"{base}-retry1") == "SUCCEEDED"
    assert "resumed" in hook.logs(f"{base}-retry1")
    assert context["ti"].xcoms["ray_submission_id"] == f"{base}-retry1"
    assert context["ti"].try_number == 1


def test_any_other_exit_code_still_fails_the_try(ray_head: str) -> None:
    from airflow.sdk.exceptions import AirflowException

    op, context, base = _operator(_unique("fail"), 3)
    with pytest.raises(AirflowException, match=f"Ray job {base} error: status=FAILED"):
        op.execute(context)
    assert RayJobHook(CONN_ID).find_status(f"{base}-retry1") is None  # nothing resubmitted
