"""The ``register_model`` task, and the warm start that reads its result back.

``register_best`` picks the best evaluated checkpoint (a later one replaces an earlier one only on a paired
win, :mod:`rlhf_ops.pipeline.promotion`), logs its HF export with its model card to the pipeline's MLflow run
as an MLflow Model (``model/``, the transformers flavour: ``mlflow.pyfunc.load_model`` and ``mlflow models serve``
load it; :mod:`rlhf_ops.tracking.mlflow_model`),
registers it as a new version of the pipeline's registered model and moves the ``champion`` alias to it only
on a win over the champion that holds on the eval set (:mod:`rlhf_ops.pipeline.champion`). A LoRA run's version
also records the base model its adapter needs (``rlhf.adapter_base_model*`` tags,
:mod:`rlhf_ops.tracking.adapter_tags`).
``fetch_champion`` (the ``fetch_champion`` Ray job) downloads ``models:/<name>@champion`` for a run that
warm-starts from it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.checkpoints import collect_eval_reports, find_checkpoint, local_checkpoint
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.promotion import PromotionSpec
from rlhf_ops.storage.manifest import step_dir_name

log = logging.getLogger(__name__)

CHAMPION_ALIAS = "champion"


def register_best(
    layout: RunLayout,
    *,
    config: Mapping[str, Any],
    mlflow_run_id: str,
    registered_name: str,
    metric: str,
    promotion: PromotionSpec | None = None,
    eval_n_samples: int = 4,
    eval_max_prompts: int = 128,
    move: bool = True,
    engine: str = "auto",
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Register the run's best checkpoint; move the champion alias only on a win that holds on the eval set.

        The best checkpoint and the champion decision come from the paired test of :mod:`rlhf_ops.pipeline.promotion`
        (``promotion``; its metric defaults to ``metric``). With ``move=False`` (the approval gate) the decision is
        made and logged and the alias waits for :func:`rlhf_ops.pipeline.champion.move_champion`. The champion is
    evaluated with ``engine`` (:func:`rlhf_ops.pipeline.evaluate.eval_engine`), as the checkpoints were.

        Returns:
            ``{"best_step", "metric", "value", "model_uri", "registered_name", "version", "champion_version",
            "decision", "summary", "checkpoint_decisions", "promote", "promoted"}``.

        Raises:
            ValueError: no checkpoint of the run was evaluated, or the metric has no per-prompt scores.
    """
    from rlhf_ops.checkpoint.model_card import card_from_config, write_model_card
    from rlhf_ops.pipeline.champion import decide, move_champion
    from rlhf_ops.tracking.mlflow_tracking import MlflowLogger

    spec = promotion or PromotionSpec()
    test_metric = spec.metric_name(metric)
    reports = collect_eval_reports(layout)
    if not reports:
        raise ValueError(f"no evaluated checkpoint under {layout.checkpoint_url}; check the evaluate tasks")

    def log_export(step: int) -> str:
        export = _export(step, layout, config)
        metrics = reports.get(step, {}).get("metrics") or {}
        checkpoint = f"{layout.checkpoint_url}/{step_dir_name(step)}"
        card = card_from_config(config, checkpoint=checkpoint, step=step, metrics=metrics)
        write_model_card(export, card)  # the export's card, completed with the data, algorithm and metrics
        logger = MlflowLogger(mlflow_run_id, tracking_uri=tracking_uri, log_system_metrics=False)
        try:
            model_uri = logger.log_mlflow_model(export, artifact_path="model")
        finally:
            logger.close()
        assert model_uri is not None  # rank 0 always returns the URI
        return model_uri

    def evaluate_champion() -> dict[str, Any]:
        from rlhf_ops.evaluation.evaluator import evaluate_model
        from rlhf_ops.pipeline.evaluate import eval_data, eval_settings

        model_dir = download_champion(registered_name, models_dir=layout.models_dir, tracking_uri=tracking_uri)
        assert model_dir is not None  # called only when a champion exists
        settings = eval_settings(config, n_samples=eval_n_samples, max_prompts=eval_max_prompts, engine=engine)
        return evaluate_model(model_dir, eval_data(config), reward_fn=config["reward"]["reward_fn"], settings=settings)

    result = decide(
        reports,
        spec=spec,
        metric=test_metric,
        mlflow_run_id=mlflow_run_id,
        registered_name=registered_name,
        register=log_export,
        evaluate_champion=evaluate_champion if config["reward"].get("reward_fn") else None,
        tracking_uri=tracking_uri,
    )
    _tag_adapter_base(result, layout, config, registered_name=registered_name, tracking_uri=tracking_uri)
    result["promoted"] = move_champion(result, run_id=mlflow_run_id, tracking_uri=tracking_uri) if move else False
    log.info(
        "registered %s v%s (step %d, %s=%s); champion moved: %s",
        registered_name,
        result["version"],
        result["best_step"],
        test_metric,
        result["value"],
        result["promoted"],
    )
    return result


def _tag_adapter_base(
    result: Mapping[str, Any],
    layout: RunLayout,
    config: Mapping[str, Any],
    *,
    registered_name: str,
    tracking_uri: str | None,
) -> None:
    """Tags the registered version with the base model its LoRA adapter needs (nothing for a full fine-tune)."""
    from mlflow import MlflowClient

    from rlhf_ops.models.resolve import resolve_model_path
    from rlhf_ops.tracking.adapter_tags import adapter_version_tags

    base = str(config["model"]["path"])
    export = _export(int(result["best_step"]), layout, config)
    tags = adapter_version_tags(export, base_model=base, base_model_path=resolve_model_path(base))
    client = MlflowClient(tracking_uri=tracking_uri)
    for key, value in tags.items():
        client.set_model_version_tag(registered_name, str(result["version"]), key, value)
    if tags:
        log.info("registered %s v%s: an adapter on %s", registered_name, result["version"], base)


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


def fetch_champion(registered_name: str, *, models_dir: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """Download ``models:/<registered_name>@champion`` under ``models_dir`` (the ``fetch_champion`` Ray job).

    The folder is keyed by version (``<models_dir>/<name>/v<version>``) and reused when complete, so retries and
    later runs of the same champion download nothing.

    Returns:
        ``{"registered_name", "version", "model_dir"}``: the HF model folder inside the version's folder; version and
        folder None when there is no champion yet (the first run of a pipeline starts from the preset's model).

    Raises:
        ValueError: the champion holds no HF model folder (no ``config.json``).
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

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
        return {"registered_name": registered_name, "version": None, "model_dir": None}
    dest = Path(models_dir) / registered_name / f"v{version.version}"
    if not (dest / ".complete").is_file():
        _download_into(dest, registered_name=registered_name, version=str(version.version), tracking_uri=tracking_uri)
    configs = sorted(dest.rglob("config.json"), key=lambda p: len(p.parts))  # the artifact folder's own config
    if not configs:
        raise ValueError(f"{registered_name} v{version.version} has no config.json; register an HF model folder")
    model_dir = configs[0].parent
    log.info("warm start from %s v%s: %s", registered_name, version.version, model_dir)
    return {"registered_name": registered_name, "version": str(version.version), "model_dir": str(model_dir)}


def download_champion(registered_name: str, *, models_dir: str, tracking_uri: str | None = None) -> str | None:
    """Local folder of ``models:/<registered_name>@champion`` under ``models_dir``, or None without a champion."""
    fetched = fetch_champion(registered_name, models_dir=models_dir, tracking_uri=tracking_uri)
    return None if fetched["model_dir"] is None else str(fetched["model_dir"])


def _download_into(dest: Path, *, registered_name: str, version: str, tracking_uri: str | None) -> None:
    """Download one model version into ``dest``, atomically: concurrent runs warm-starting from it share ``dest``.

    Each caller downloads into its own temporary sibling and renames it into place; a caller that finds ``dest``
    completed by another meanwhile drops its copy. The version is the one resolved by the caller (the alias may
    move while it downloads).
    """
    import shutil
    import tempfile

    from rlhf_ops.tracking.registry import download_model

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        download_model(registered_name=registered_name, dst_path=tmp, version=version, tracking_uri=tracking_uri)
        (tmp / ".complete").write_text(f"{registered_name} v{version}\n")
        if dest.exists() and not (dest / ".complete").is_file():
            shutil.rmtree(dest, ignore_errors=True)  # left by a download killed before this rule existed
        try:
            tmp.rename(dest)
        except OSError:  # another run renamed its complete copy into place first
            if not (dest / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
