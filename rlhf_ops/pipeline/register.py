"""The ``register_model`` task, and the warm start that reads its result back.

``register_best`` picks the best evaluated checkpoint by the eval metric, logs its HF export to the
pipeline's MLflow run (``model/``), registers it as a new version of the pipeline's registered model and
moves the ``champion`` alias to it only if it beats the current champion (``register_if_better``).
``download_champion`` fetches ``models:/<name>@champion`` for a run that warm-starts from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.checkpoints import best_step, collect_eval_reports, find_checkpoint, local_checkpoint
from rlhf_ops.pipeline.layout import RunLayout

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"


def register_best(
    layout: RunLayout,
    *,
    config: Mapping[str, Any],
    mlflow_run_id: str,
    registered_name: str,
    metric: str,
    higher_is_better: bool = True,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Log and register the best checkpoint's HF export; move the champion alias if it is better.

    Returns:
        ``{"best_step", "metric", "value", "model_uri", "registered_name", "version", "promoted"}``.

    Raises:
        ValueError: no checkpoint of the run was evaluated (nothing to choose from).
    """
    from rlhf_ops.tracking.mlflow_tracking import MlflowLogger, register_if_better, set_run_tags

    reports = collect_eval_reports(layout)
    step = best_step(reports, metric, higher_is_better=higher_is_better)
    if step is None:
        raise ValueError(f"no evaluated checkpoint under {layout.checkpoint_url}; check the evaluate tasks")
    export = _export(step, layout, config)
    logger = MlflowLogger(mlflow_run_id, tracking_uri=tracking_uri, log_system_metrics=False)
    try:
        model_uri = logger.log_model_dir(export, artifact_path="model")
    finally:
        logger.close()
    assert model_uri is not None  # rank 0 always returns the URI
    value = float(reports[step]["metrics"][metric])
    version, promoted = register_if_better(
        run_id=mlflow_run_id,
        model_uri=model_uri,
        registered_name=registered_name,
        metric_name=metric,
        metric_value=value,
        higher_is_better=higher_is_better,
        alias=CHAMPION_ALIAS,
        tracking_uri=tracking_uri,
    )
    tags = {
        "rlhf.best_step": step,
        "rlhf.registered_model": registered_name,
        "rlhf.model_version": version or "",
        "rlhf.promoted": str(promoted).lower(),
    }
    set_run_tags(tracking_uri=tracking_uri, run_id=mlflow_run_id, tags=tags)
    log.info(
        "registered %s v%s (step %d, %s=%s); champion moved: %s",
        registered_name,
        version,
        step,
        metric,
        value,
        promoted,
    )
    return {
        "best_step": step,
        "metric": metric,
        "value": value,
        "model_uri": model_uri,
        "registered_name": registered_name,
        "version": version,
        "promoted": promoted,
    }


def _export(step: int, layout: RunLayout, config: Mapping[str, Any]) -> Path:
    """The HF export of checkpoint ``step`` (made by its evaluation, or made now)."""
    from rlhf_ops.evaluation.evaluator import ensure_export
    from rlhf_ops.models.resolve import resolve_model_path

    location = find_checkpoint(step, layout)
    if location is None:
        raise ValueError(f"the best checkpoint global_step_{step} is gone from {layout.checkpoint_url}")
    ckpt = local_checkpoint(step, layout, location)
    tokenizer = config["model"].get("tokenizer_path")
    return ensure_export(
        ckpt,
        layout.export_dir(step),
        base_model_path=resolve_model_path(config["model"]["path"]),
        tokenizer_path=resolve_model_path(tokenizer) if tokenizer else None,
    )


def download_champion(registered_name: str, *, models_dir: str, tracking_uri: str | None = None) -> str | None:
    """Local folder of ``models:/<registered_name>@champion`` under ``models_dir``, or None without a champion.

    The folder is keyed by version (``<models_dir>/<name>/v<version>``) and reused when complete, so retries and
    later runs of the same champion download nothing.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from rlhf_ops.tracking.registry import download_model

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        version = client.get_model_version_by_alias(registered_name, CHAMPION_ALIAS)
    except MlflowException as exc:  # no such model or no alias yet: the first run of a pipeline
        log.warning(
            "no %s@%s to warm-start from (%s); starting from the preset's model",
            registered_name,
            CHAMPION_ALIAS,
            exc.error_code,
        )
        return None
    dest = Path(models_dir) / registered_name / f"v{version.version}"
    if not (dest / ".complete").is_file():
        download_model(registered_name=registered_name, dst_path=dest, tracking_uri=tracking_uri)
        (dest / ".complete").write_text(f"{registered_name} v{version.version}\n")
    configs = sorted(dest.rglob("config.json"), key=lambda p: len(p.parts))  # the artifact folder's own config
    if not configs:
        raise ValueError(f"{registered_name} v{version.version} has no config.json; register an HF model folder")
    model_dir = configs[0].parent
    log.info("warm start from %s v%s: %s", registered_name, version.version, model_dir)
    return str(model_dir)
