"""Operator extra links: the Ray job page, the MLflow run and the checkpoint folder.

Where ``get_link`` runs in Airflow 3.3:
* on the worker, when a task attempt ends or defers (``task_runner.finalize``), for the links the operator
  class declares; the result is stored in XCom under ``link.xcom_key`` and the API server shows it through a
  generic ``XComOperatorLink`` even without this plugin;
* in the API server, for links registered by ``RlhfPlugin`` (plugin links win over the stored ones by name);
  there is no Task SDK there, so XComs are read from the metadata DB.
``_read_xcom`` picks the right path, so one class serves both.

Config (``[rlhf]`` section, or ``AIRFLOW__RLHF__<KEY>`` env vars), read where the link is rendered:
    ``mlflow_tracking_task_id`` (default ``start_tracking``): task whose XCom ``mlflow_run_url`` is used when the
    task itself has none. ``checkpoint_task_id`` (default none): same for ``checkpoint_url``.
    ``s3_console_url_template``: e.g. ``https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={key}/`` or
    ``http://minio:9001/browser/{bucket}/{key}``; ``{bucket}``, ``{key}`` (URL-quoted) and ``{url}`` are filled.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

XCOM_SUBMISSION_ID = "ray_submission_id"
XCOM_DASHBOARD_URL = "ray_dashboard_url"
XCOM_MLFLOW_RUN_URL = "mlflow_run_url"
XCOM_CHECKPOINT_URL = "checkpoint_url"
DEFAULT_TRACKING_TASK_ID = "start_tracking"


def ray_job_url(dashboard_url: str, submission_id: str) -> str:
    """Ray dashboard page of one job: ``<dashboard>/#/jobs/<submission_id>``."""
    return f"{dashboard_url.rstrip('/')}/#/jobs/{quote(submission_id, safe='')}"


def checkpoint_browser_url(url: str, *, s3_console_template: str | None = None) -> str:
    """URL to show for a checkpoint folder.

    ``s3://bucket/key`` is mapped through ``s3_console_template`` when one is given; every other URL
    (``file://``, ``hdfs://``, ``s3://`` without a template…) is returned unchanged.
    """
    if not url.startswith("s3://") or not s3_console_template:
        return url
    bucket, _, key = url[len("s3://") :].partition("/")
    return s3_console_template.format(bucket=bucket, key=quote(key.strip("/"), safe="/"), url=url)


def _conf(key: str, default: str = "") -> str:
    from rlhf_airflow.compat import conf

    return conf.get("rlhf", key, fallback=default) or default


def _in_task_runner() -> bool:
    # Same test the Task SDK uses (supervisor.py): a task process has task_runner.SUPERVISOR_COMMS set.
    runner = sys.modules.get("airflow.sdk.execution_time.task_runner")
    return runner is not None and getattr(runner, "SUPERVISOR_COMMS", None) is not None


def _read_xcom(ti_key: TaskInstanceKey, *, key: str, task_id: str) -> Any:
    """XCom ``key`` of ``task_id`` in the run of ``ti_key`` (own map index for own task, -1 for others)."""
    map_index = ti_key.map_index if task_id == ti_key.task_id else -1
    if _in_task_runner():
        from airflow.sdk.execution_time.xcom import XCom

        ids = {"key": key, "dag_id": ti_key.dag_id, "task_id": task_id, "run_id": ti_key.run_id}
        if map_index >= 0:
            return XCom.get_one(**ids, map_index=map_index)
        # get_one logs an ERROR for every missing key; the slice query of an unmapped task just returns nothing.
        values = XCom.get_all(**ids)
        return values[0] if values else None
    # API server: no Task SDK comms; read the metadata DB like airflow's own XComOperatorLink does.
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(
            key=key, run_id=ti_key.run_id, dag_ids=ti_key.dag_id, task_ids=task_id, map_indexes=map_index
        )
        row = session.execute(query.with_only_columns(XComModel.value)).first()
    if row is None:
        return None
    value = row[0]
    try:
        return json.loads(value) if isinstance(value, str | bytes) else value
    except ValueError:
        return value


def _first_url(ti_key: TaskInstanceKey, key: str, task_ids: list[str]) -> str:
    for task_id in dict.fromkeys(t for t in task_ids if t):  # ordered, de-duplicated
        value = _read_xcom(ti_key, key=key, task_id=task_id)
        if isinstance(value, str) and value:
            return value
    return ""


class RayJobLink(BaseOperatorLink):
    """Ray dashboard page of the task's job (XCom ``ray_dashboard_url``, else dashboard base + submission id)."""

    name = "Ray job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """Return the job page URL, or "" before the job was submitted."""
        if url := _first_url(ti_key, XCOM_DASHBOARD_URL, [ti_key.task_id]):
            return url
        base = _conf("ray_dashboard_url")
        submission_id = _first_url(ti_key, XCOM_SUBMISSION_ID, [ti_key.task_id])
        return ray_job_url(base, submission_id) if base and submission_id else ""


class MlflowRunLink(BaseOperatorLink):
    """MLflow run of the pipeline run: XCom ``mlflow_run_url`` of the task itself, else of the tracking task."""

    name = "MLflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """Return the run URL, or "" when no task pushed one."""
        tracking = _conf("mlflow_tracking_task_id", DEFAULT_TRACKING_TASK_ID)
        return _first_url(ti_key, XCOM_MLFLOW_RUN_URL, [ti_key.task_id, tracking])


class CheckpointFolderLink(BaseOperatorLink):
    """Checkpoint folder: XCom ``checkpoint_url`` (own task, else ``[rlhf] checkpoint_task_id``)."""

    name = "Checkpoints"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """Return the folder URL (s3:// mapped to a console URL when configured), or ""."""
        url = _first_url(ti_key, XCOM_CHECKPOINT_URL, [ti_key.task_id, _conf("checkpoint_task_id")])
        return checkpoint_browser_url(url, s3_console_template=_conf("s3_console_url_template")) if url else ""
