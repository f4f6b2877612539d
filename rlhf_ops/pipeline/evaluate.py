"""The per-checkpoint tasks: wait until checkpoint N is committed, then evaluate it.

``checkpoint_ready`` (``rlhf_ops.pipeline.checkpoints``, torch-free: the Airflow sensor imports it) is the
sensor's poke; ``evaluate_step`` exports the checkpoint to HF (or reuses an
export), evaluates it on the run's validation files with the run's reward function, writes ``eval.json``
beside it (locally and on the remote store) and logs the metrics to the pipeline's MLflow run at step N.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rlhf_ops.pipeline.checkpoints import (  # noqa: F401 - CheckpointNeverCommitted, checkpoint_ready: old home
    CheckpointNeverCommitted,
    checkpoint_ready,
    find_checkpoint,
    local_checkpoint,
    write_eval_report,
)
from rlhf_ops.pipeline.layout import RunLayout

log = logging.getLogger(__name__)


def eval_engine(config: Mapping[str, Any], engine: str = "auto") -> str:
    """The rollout engine an evaluation decodes with: ``engine``, or for ``auto`` the run's ``rollout.engine``.

    ``auto`` makes evaluation decode with the engine training generated with (vLLM on the GPU presets; HF on the
    tiny CPU preset, whose model vLLM's CPU attention cannot run). An engine whose package is not installed on
    this node (vLLM, SGLang) falls back to HF, with a warning that gives the reason.

    Raises:
        ValueError: ``engine`` is neither ``auto`` nor an engine of the table.
    """
    from rlhf_ops.extensions import ROLLOUT_ENGINES, is_dotted

    if engine != "auto" and engine not in ROLLOUT_ENGINES and not is_dotted(engine):
        raise ValueError(f"eval_engine={engine!r} must be auto or one of {ROLLOUT_ENGINES.names()}")
    chosen = str(config["rollout"].get("engine") or "hf") if engine == "auto" else engine
    spec = ROLLOUT_ENGINES.known(chosen)
    missing = spec.missing_package() if spec is not None else None
    if missing:
        log.warning("%s; evaluating with the HF engine instead", missing)
        return "hf"
    return chosen


def eval_settings(config: Mapping[str, Any], *, n_samples: int, max_prompts: int, engine: str = "auto") -> Any:
    """``EvalSettings`` from the run's rollout config and the form's evaluation values."""
    from rlhf_ops.evaluation.evaluator import EvalSettings

    rollout = config["rollout"]
    return EvalSettings(
        engine=eval_engine(config, engine),
        max_prompts=max_prompts,
        n_samples=n_samples,
        max_new_tokens=int(rollout["max_new_tokens"]),
        temperature=float(rollout["temperature"]),
        top_p=float(rollout["top_p"]),
        top_k=int(rollout["top_k"]),
        seed=int(config["trainer"]["seed"]),
        dtype="float32",
    )


def eval_data(config: Mapping[str, Any]) -> Any:
    """``EvalData`` from the run's data config: the validation files, or the training files when there are none."""
    from rlhf_ops.evaluation.evaluator import EvalData

    data = config["data"]
    files = list(data.get("val_files") or [])
    if not files:
        log.warning("the run has no validation files; evaluating on the training files")
        files = list(data["train_files"])
    return EvalData(
        files=files,
        max_prompt_length=int(data["max_prompt_length"]),
        prompt_key=data["prompt_key"],
        ground_truth_key=data["ground_truth_key"],
        data_source_key=data["data_source_key"],
        apply_chat_template=bool(data["apply_chat_template"]),
        toy_rows=int(data["toy_rows"]),
        seed=int(config["trainer"]["seed"]) + 7919,
    )


def evaluate_step(
    step: int,
    *,
    location: str,
    config: Mapping[str, Any],
    layout: RunLayout,
    mlflow_run_id: str | None,
    n_samples: int,
    max_prompts: int,
    engine: str = "auto",
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Evaluate committed checkpoint ``step`` (at ``location``: local path or remote URL) with ``engine``
    (:func:`eval_engine`).

    Returns:
        ``{"step", "metrics", "eval_files"}`` (a small XCom; the full report is ``eval.json``).

    Raises:
        ValueError: the run has no rule reward function (``reward.reward_fn``) to score with.
    """
    from rlhf_ops.evaluation.evaluator import ensure_export, evaluate_model, log_eval_to_mlflow
    from rlhf_ops.models.resolve import resolve_model_path

    reward_fn = config["reward"].get("reward_fn")
    if not reward_fn:
        raise ValueError("reward.reward_fn is not set; evaluation scores with a rule reward function, set one")
    ckpt = local_checkpoint(step, layout, location)
    base_model = resolve_model_path(config["model"]["path"])
    tokenizer = config["model"].get("tokenizer_path")
    model_dir = ensure_export(
        ckpt,
        layout.export_dir(step),
        base_model_path=base_model,
        tokenizer_path=resolve_model_path(tokenizer) if tokenizer else None,
    )
    settings = eval_settings(config, n_samples=n_samples, max_prompts=max_prompts, engine=engine)
    report = evaluate_model(model_dir, eval_data(config), reward_fn=reward_fn, settings=settings)
    report.update(step=step, checkpoint=location)
    places = write_eval_report(report, step=step, local_dir=ckpt, layout=layout)
    if mlflow_run_id:
        log_eval_to_mlflow(report, run_id=mlflow_run_id, step=step, tracking_uri=tracking_uri)
    return {"step": step, "metrics": report["metrics"], "eval_files": places, "engine": settings.engine}
