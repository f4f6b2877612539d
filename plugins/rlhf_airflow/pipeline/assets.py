"""The pipeline's Airflow Assets: the prepared data set, each committed checkpoint, the registered model.

Asset URIs are static (one Asset per pipeline and kind, ``x-rlhf://<dag_id>/<kind>``: Airflow keys Assets by
name and URI at parse time); what a run produced is the event's ``extra`` (the real URLs, counts, step, metrics,
model version). ``champion`` gets an event only when the alias moved, so a downstream DAG scheduled on it
(``dags/rlhf_champion_report.py``) runs once per new champion.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import Asset

KINDS = ("champion",)
"""The kinds no heavy job emits; the others are the heavy jobs' ``asset`` (prepared_data, checkpoint,
registered_model: ``rlhf_ops.pipeline.job_requests.PIPELINE_JOBS``)."""


def asset_kinds() -> tuple[str, ...]:
    """Every kind: the heavy jobs' assets, then :data:`KINDS`."""
    from rlhf_ops.pipeline.job_requests import PIPELINE_JOBS

    return (*(job.asset for job in PIPELINE_JOBS if job.asset), *KINDS)


def pipeline_asset(dag_id: str, kind: str) -> Asset:
    """The Asset of ``kind`` (one of :func:`asset_kinds`) of pipeline ``dag_id``."""
    if kind not in asset_kinds():
        raise ValueError(f"unknown asset kind {kind!r}; one of {asset_kinds()}")
    return Asset(
        name=f"{dag_id}.{kind}",
        uri=f"x-rlhf://{dag_id}/{kind.replace('_', '-')}",
        group="rlhf",
        extra={"pipeline": dag_id, "kind": kind},
    )


def set_event_extra(context: Mapping[str, Any], kind: str, extra: Mapping[str, Any]) -> None:
    """Attach ``extra`` (JSON values) to the outlet event of ``kind`` that this task emits on success."""
    events = context.get("outlet_events")
    if events is None:  # called outside a task run (unit tests of the task body)
        return
    asset = pipeline_asset(context["dag"].dag_id, kind)
    events[asset].extra.update({k: v for k, v in extra.items() if v is not None})
