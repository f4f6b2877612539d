"""The ``start_tracking`` and ``end_tracking`` tasks: the pipeline run's MLflow run, opened before training.

``start_tracking`` creates (or, on a retry, finds again) the run tagged with the Airflow DAG id, run id and
try number and the platform's git commit, then logs the resolved config as params and as an artifact, the
data manifest, the prepared train and validation files as MLflow dataset inputs (source and digest,
:mod:`rlhf_ops.tracking.datasets`) and a sample of the rejected rows, so every later artifact has a home even if
training fails.
The training job attaches to the run through ``MLFLOW_RUN_ID``; evaluation logs at each checkpoint's step.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

UI_URL_ENV = "RLHF_MLFLOW_UI_URL"
MAX_REJECTED_SAMPLE = 100


def mlflow_run_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run: ``<ui>/#/experiments/<experiment id>/runs/<run id>``."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def read_json(url: str) -> dict[str, Any]:
    from rlhf_ops.storage import open_store

    fs, path = open_store(url)
    with fs.open(path, "rb") as f:
        data = json.loads(f.read())
    if not isinstance(data, dict):
        raise ValueError(f"{url} does not hold a JSON object")
    return data


def read_jsonl_head(url: str, limit: int) -> list[dict[str, Any]]:
    from rlhf_ops.storage import open_store

    fs, path = open_store(url)
    if not fs.exists(path):
        return []
    rows: list[dict[str, Any]] = []
    with fs.open(path, "rt") as f:
        for line in f:
            if len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def data_sha256(manifest: Mapping[str, Any]) -> str:
    """One digest of a prepared data set: sha256 over its files' ``name:sha256`` lines (manifest order-free)."""
    import hashlib

    files = manifest.get("files") or {}
    lines = sorted(f"{name}:{info.get('sha256', '')}" for name, info in files.items() if isinstance(info, Mapping))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest() if lines else "unknown"


def compare_fields(
    config: Mapping[str, Any], *, preset: str, dag_id: str, dag_run_id: str, manifest: Mapping[str, Any]
) -> dict[str, str]:
    """What two runs are told apart by in MLflow's compare view: preset, algorithm, model, data, code, DAG run.

    Logged as ``pipeline.<name>`` params (the compare view's parameter table) and ``rlhf.<name>`` tags.
    """
    from rlhf_ops.tracking.mlflow_tracking import platform_git_commit

    return {
        "preset": preset,
        "algorithm": str(config["algorithm"]["adv_estimator"]),
        "model": str(config["model"]["path"]),
        "data_sha256": data_sha256(manifest),
        "platform_commit": platform_git_commit(),
        "dag_run": f"{dag_id}/{dag_run_id}",
    }


def start_tracking(
    *,
    config: Mapping[str, Any],
    preset: str,
    dag_id: str,
    dag_run_id: str,
    try_number: int,
    run_date: dt.datetime,
    prepared: Mapping[str, Any],
    extra_tags: Mapping[str, str] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, str]:
    """Open the pipeline's MLflow run and log what is known before training.

    Args:
        config: The resolved config (``preflight``'s ``config``).
        preset: Preset name (part of the run name).
        dag_id: Airflow DAG id (tag).
        dag_run_id: Airflow run id (tag; the key that makes a retry find the same MLflow run).
        try_number: This task's try (tag).
        run_date: The run's date, shown in the run name.
        prepared: ``prepare_data``'s result (manifest and rejected rows URLs).
        extra_tags: More tags (e.g. ``rlhf.checkpoint_url``).
        tracking_uri: MLflow server; None uses ``$MLFLOW_TRACKING_URI``.

    Returns:
        ``{"mlflow_run_id", "mlflow_run_url", "mlflow_experiment_id"}``.
    """
    from mlflow import MlflowClient

    from rlhf_ops.pipeline.layout import run_key
    from rlhf_ops.tracking.artifacts import log_data_manifest, log_rejected_sample, log_resolved_config
    from rlhf_ops.tracking.datasets import log_dataset_inputs
    from rlhf_ops.tracking.mlflow_tracking import MlflowLogger, pipeline_tags, run_name_for, start_pipeline_run

    algorithm = str(config["algorithm"]["adv_estimator"])
    tags = {**pipeline_tags(dag_id=dag_id, dag_run_id=dag_run_id, try_number=try_number), **(extra_tags or {})}
    tags["rlhf.preset"] = preset
    run_id = start_pipeline_run(
        tracking_uri=tracking_uri,
        experiment=str(config["tracking"]["experiment"]),
        # Two runs triggered in the same minute get distinct names: the digest of their Airflow run ids.
        run_name=run_name_for(preset, algorithm, run_date, key=run_key(dag_run_id).rsplit("-", 1)[-1]),
        tags=tags,
    )
    manifest = prepared.get("manifest")  # the prepare_data job's own copy: its folder may not be readable here
    if manifest is None:
        manifest = read_json(str(prepared["manifest_url"])) if prepared.get("manifest_url") else {}
    fields = compare_fields(config, preset=preset, dag_id=dag_id, dag_run_id=dag_run_id, manifest=manifest)
    logger = MlflowLogger(run_id, tracking_uri=tracking_uri, log_system_metrics=False)
    try:
        logger.log_params(config)
        logger.log_params({f"pipeline.{k}": v for k, v in fields.items()})
        logger.set_tags({f"rlhf.{k}": v for k, v in fields.items() if k not in ("preset", "dag_run")})
        log_resolved_config(logger, config)
        if manifest:
            log_data_manifest(logger, manifest)
            log_dataset_inputs(run_id, prepared, manifest, tracking_uri=tracking_uri)
        if "rejected_sample" in prepared:
            log_rejected_sample(logger, list(prepared["rejected_sample"])[:MAX_REJECTED_SAMPLE])
        elif prepared.get("rejected_url"):
            log_rejected_sample(logger, read_jsonl_head(str(prepared["rejected_url"]), MAX_REJECTED_SAMPLE))
    finally:
        logger.close()
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = str(client.get_run(run_id).info.experiment_id)
    ui = os.environ.get(UI_URL_ENV) or client.tracking_uri
    return {
        "mlflow_run_id": run_id,
        "mlflow_run_url": mlflow_run_url(ui, experiment_id, run_id),
        "mlflow_experiment_id": experiment_id,
    }


def end_tracking(
    *, run_id: str, failed: bool, tags: Mapping[str, str] | None = None, tracking_uri: str | None = None
) -> str:
    """Close the MLflow run FINISHED (or FAILED when a task of the pipeline failed); returns the status."""
    from rlhf_ops.tracking.mlflow_tracking import end_pipeline_run, set_run_tags

    if tags:
        set_run_tags(tracking_uri=tracking_uri, run_id=run_id, tags=tags)
    status = "FAILED" if failed else "FINISHED"
    end_pipeline_run(tracking_uri=tracking_uri, run_id=run_id, status=status)
    log.info("MLflow run %s ended %s", run_id, status)
    return status
