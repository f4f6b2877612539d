"""Failure callbacks: a short failure summary where the person on call looks first.

When a task of the pipeline fails for good (``on_failure_callback``; retries call ``on_retry_callback``, not
this), :func:`on_task_failure` builds a summary of a few lines (the task, the first line of the error, the links
to the Ray job, the MLflow run and the task's log) and writes it

- to the task log (``failure summary: ...``), always;
- to the pipeline's MLflow run as the tags ``rlhf.failure`` (the summary) and ``rlhf.failed_task``, when the run
  was opened (``start_tracking`` ran);
- to the DAG run's note (shown on the run's page), when the ``airflow_api`` connection is defined: the Task SDK
  offers a task no call that sets it, so the callback uses the public REST API (``PATCH
  /api/v2/dags/{dag_id}/dagRuns/{run_id}``, ``update_mask=note``) as a user: the connection's host is the API
  server's base URL, and either its login / password (a ``POST /auth/token`` for a JWT) or, without a login, its
  password is the token. An existing note is kept below the summary (the note holds 1000 characters).

A callback never raises: a broken callback must not hide the task's own error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 300
MAX_NOTE = 1000  # DAGRunPatchBody.note
API_CONN_ID = "airflow_api"


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
    from rlhf_airflow.pipeline.tasks import connection_env
    from rlhf_ops.pipeline.layout import patched_environ
    from rlhf_ops.tracking.mlflow_tracking import set_run_tags

    with patched_environ(connection_env(s3_conn_id=None, mlflow_conn_id=mlflow_conn_id)):
        set_run_tags(
            tracking_uri=None,
            run_id=str(run_id),
            tags={"rlhf.failure": summary["text"], "rlhf.failed_task": summary["task"]},
        )
    return True


def api_base_url(conn: Any) -> str:
    """The API server's base URL of an ``http`` connection (host may hold the whole URL)."""
    host = str(conn.host or "").rstrip("/")
    if "://" not in host:
        host = f"{conn.schema or 'http'}://{host}"
    if conn.port and host.count(":") < 2:
        host = f"{host}:{conn.port}"
    return host


def _api_token(conn: Any, base: str, timeout_s: float) -> str:
    import requests

    if not conn.login:
        return str(conn.password or "")
    resp = requests.post(
        f"{base}/auth/token", json={"username": conn.login, "password": conn.password}, timeout=timeout_s
    )
    resp.raise_for_status()
    return str(resp.json()["access_token"])


def write_run_note(
    dag_id: str, run_id: str, text: str, *, api_conn_id: str | None = API_CONN_ID, timeout_s: float = 20.0
) -> bool:
    """Put ``text`` at the top of the DAG run's note through the REST API; False when no connection is defined."""
    from urllib.parse import quote

    import requests
    from airflow.sdk import BaseHook

    from rlhf_airflow.compat import AirflowNotFoundException

    if not api_conn_id:
        return False
    try:
        conn = BaseHook.get_connection(api_conn_id)
    except AirflowNotFoundException:
        return False
    base = api_base_url(conn)
    headers = {"Authorization": f"Bearer {_api_token(conn, base, timeout_s)}"}
    url = f"{base}/api/v2/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}"
    current = requests.get(url, headers=headers, timeout=timeout_s)
    current.raise_for_status()
    previous = current.json().get("note") or ""
    note = text if not previous else f"{text}\n\n{previous}"
    resp = requests.patch(
        url, params={"update_mask": "note"}, json={"note": note[:MAX_NOTE]}, headers=headers, timeout=timeout_s
    )
    resp.raise_for_status()
    return True


def on_task_failure(
    context: Mapping[str, Any], *, mlflow_conn_id: str | None = "mlflow_default", api_conn_id: str | None = API_CONN_ID
) -> dict[str, str]:
    """``on_failure_callback`` of every pipeline task (see the module docstring); returns the summary."""
    summary = failure_summary(context)
    log.error("failure summary:\n%s", summary["text"])
    try:
        if _tag_mlflow(context, summary, mlflow_conn_id=mlflow_conn_id):
            log.info("failure summary written to the MLflow run's rlhf.failure tag")
    except Exception as exc:  # MLflow down: the log line above still has everything
        log.warning("could not tag the MLflow run with the failure summary: %s", exc)
    ti = context["ti"]
    try:
        if write_run_note(str(ti.dag_id), str(ti.run_id), summary["text"], api_conn_id=api_conn_id):
            log.info("failure summary written to the DAG run's note")
        else:
            log.info("no %r connection: the DAG run's note is left as it is", api_conn_id)
    except Exception as exc:  # API server down, a bad token: the log line above still has everything
        log.warning("could not write the failure summary to the DAG run's note: %s", exc)
    return summary
