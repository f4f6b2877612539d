"""The per-checkpoint tasks: wait until checkpoint N is committed, then evaluate it.

``checkpoint_ready`` is the sensor's poke; ``evaluate_step`` exports the checkpoint to HF (or reuses an
export), evaluates it on the run's validation files with the run's reward function, writes ``eval.json``
beside it (locally and on the remote store) and logs the metrics to the pipeline's MLflow run at step N.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rlhf_ops.pipeline.checkpoints import find_checkpoint, local_checkpoint, write_eval_report
from rlhf_ops.pipeline.layout import RunLayout

log = logging.getLogger(__name__)

TRAIN_DONE_STATES = frozenset({"success"})
TRAIN_FAILED_STATES = frozenset({"failed", "upstream_failed", "removed"})


class CheckpointNeverCommitted(RuntimeError):
    """Training ended without committing the awaited checkpoint."""


def checkpoint_ready(step: int, layout: RunLayout, *, train_state: str | None, local: bool = True) -> str | None:
    """Where checkpoint ``step`` is, or None to keep waiting.

    Args:
        step: The awaited global step.
        layout: The run's layout.
        train_state: The Airflow state of the training task (``None`` before it was scheduled).
        local: Look in the local run folder too (False: only the remote store, for a caller off the cluster).

    Raises:
        CheckpointNeverCommitted: training succeeded (or failed for good) and the checkpoint is not there.
    """
    found = find_checkpoint(step, layout, local=local)
    if found is not None:
        return found
    if train_state in TRAIN_DONE_STATES or train_state in TRAIN_FAILED_STATES:
        # A finished job has waited for its uploads, so a missing checkpoint will not appear any more.
        raise CheckpointNeverCommitted(
            f"training is {train_state} and global_step_{step} was never committed under {layout.checkpoint_url}"
        )
    return None


EVAL_ENGINES = ("auto", "vllm", "hf")


def eval_engine(config: Mapping[str, Any], engine: str = "auto") -> str:
    """The generation engine of an evaluation: ``vllm`` (batched, the engine GPU runs train with) or ``hf``.

    ``auto`` takes the run's ``rollout.engine``, so evaluation decodes with the engine training generated with
    (vLLM on the GPU presets; HF on the tiny CPU preset, whose model vLLM's CPU attention cannot run). A vLLM
    evaluation where vLLM is not installed falls back to HF, with a warning.

    Raises:
        ValueError: ``engine`` is not one of ``auto``, ``vllm``, ``hf``.
    """
    if engine not in EVAL_ENGINES:
        raise ValueError(f"eval_engine={engine!r} must be one of {list(EVAL_ENGINES)}")
    chosen = str(config["rollout"].get("engine") or "hf") if engine == "auto" else engine
    if chosen == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            log.warning("vLLM is not installed on this node; evaluating with the HF engine instead")
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
