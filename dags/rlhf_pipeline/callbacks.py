"""Failure callbacks: a short failure summary where the person on call looks first.

When a task of the pipeline fails for good (``on_failure_callback``; retries call ``on_retry_callback``, not
this), :func:`on_task_failure` builds a summary of a few lines (the task, the first line of the error, the links
to the Ray job, the MLflow run and the task's log) and writes it

- to the task log (``failure summary: ...``), always;
- to the pipeline's MLflow run as the tags ``rlhf.failure`` (the summary) and ``rlhf.failed_task``, when the run
  was opened (``start_tracking`` ran).

The DAG run note is not written yet: the Task SDK offers a task no call that sets it (only the public REST API
does, with a user token); see docs/pipeline.md. A callback never raises: a broken callback must not hide the
task's own error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 300


def first_error_line(error: BaseException | str | None) -> str:
    """The first non-empty line of the error, as ``Type: message`` (cut at :data:`MAX_LINE` characters)."""
    if error is None:
        return "unknown error (no exception in the context)"
    text = str(error).strip()
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    if isinstance(error, BaseException):
        line = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return line[:MAX_LINE]


def _pull(ti: Any, task_id: str, key: str) -> Any:
    try:
        return ti.xcom_pull(task_ids=task_id, key=key)
    except Exception:  # the task never ran, or XCom is unreachable: the summary goes without this link
        return None


def failure_summary(context: Mapping[str, Any]) -> dict[str, str]:
    """``{"task", "error", "ray_job", "mlflow_run", "log", "text"}`` of the failed task in ``context``."""
    ti = context["ti"]
    index = getattr(ti, "map_index", -1)
    task = f"{ti.task_id}[{index}]" if index is not None and index >= 0 else str(ti.task_id)
    error = first_error_line(context.get("exception"))
    ray_job = _pull(ti, "train", "ray_dashboard_url") or ""
    mlflow_run = _pull(ti, "start_tracking", "mlflow_run_url") or ""
    log_url = str(getattr(ti, "log_url", "") or "")
    lines = [f"{ti.dag_id} / {ti.run_id}: {task} failed (try {getattr(ti, 'try_number', '?')})", f"error: {error}"]
    lines += [
        f"{name}: {url}" for name, url in (("Ray job", ray_job), ("MLflow run", mlflow_run), ("log", log_url)) if url
    ]
    return {
        "task": task,
        "error": error,
        "ray_job": str(ray_job),
        "mlflow_run": str(mlflow_run),
        "log": log_url,
        "text": "\n".join(lines),
    }


def _tag_mlflow(context: Mapping[str, Any], summary: Mapping[str, str], *, mlflow_conn_id: str | None) -> bool:
    run_id = _pull(context["ti"], "start_tracking", "mlflow_run_id")
    if not run_id:
        return False
    from rlhf_ops.pipeline.layout import patched_environ
    from rlhf_ops.tracking.mlflow_tracking import set_run_tags
    from rlhf_pipeline.tasks import connection_env

    with patched_environ(connection_env(s3_conn_id=None, mlflow_conn_id=mlflow_conn_id)):
        set_run_tags(
            tracking_uri=None,
            run_id=str(run_id),
            tags={"rlhf.failure": summary["text"], "rlhf.failed_task": summary["task"]},
        )
    return True


def on_task_failure(context: Mapping[str, Any], *, mlflow_conn_id: str | None = "mlflow_default") -> dict[str, str]:
    """``on_failure_callback`` of every pipeline task (see the module docstring); returns the summary."""
    summary = failure_summary(context)
    log.error("failure summary:\n%s", summary["text"])
    try:
        if _tag_mlflow(context, summary, mlflow_conn_id=mlflow_conn_id):
            log.info("failure summary written to the MLflow run's rlhf.failure tag")
    except Exception as exc:  # MLflow down: the log line above still has everything
        log.warning("could not tag the MLflow run with the failure summary: %s", exc)
    return summary
