"""Checkpoint evaluation: HF export → generate on the validation split → score → report → MLflow.

The report (``eval.json``, written beside the checkpoint by the pipeline) holds the metrics of
:mod:`rlhf_ops.evaluation.metrics`, the settings, and the first greedy generations; the same metrics go to
MLflow at the checkpoint's global step, the report under ``eval/`` and the generations as an MLflow table
under ``generations/`` (``rlhf_ops.tracking.artifacts``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlhf_ops.evaluation.metrics import ScoredResponse, default_ks, greedy_metrics, sample_metrics
from rlhf_ops.extensions import ROLLOUT_ENGINES, is_dotted

log = logging.getLogger(__name__)

REPORT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """How a checkpoint is evaluated."""

    max_prompts: int = 128
    """Validation prompts used (the first ones, so every checkpoint sees the same prompts)."""
    n_samples: int = 4
    """Sampled responses per prompt for pass@k and mean accuracy; 0 evaluates greedy responses only."""
    ks: tuple[int, ...] = ()
    """k values of pass@k; empty: 1, 2, 4… up to ``n_samples``."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    batch_size: int = 64
    seed: int = 0
    num_examples: int = 16
    """Greedy generations kept in the report and the MLflow table."""
    dtype: str = "float32"
    engine: str = "hf"
    """The rollout engine that decodes (a ``rollout.engine`` value: ``hf``, ``vllm`` (faster), ``sglang``, an entry
    point's name or a dotted path), built as training builds it."""

    def __post_init__(self) -> None:
        if self.max_prompts < 1:
            raise ValueError(f"max_prompts={self.max_prompts} must be >= 1")
        if self.n_samples < 0:
            raise ValueError(f"n_samples={self.n_samples} must be >= 0 (0: greedy only)")
        if not is_dotted(self.engine) and self.engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"engine={self.engine!r} is no rollout engine; set one of {ROLLOUT_ENGINES.names()} or a dotted path "
                "'package.module:attribute'"
            )
        if any(not 1 <= k <= self.n_samples for k in self.ks):
            raise ValueError(f"ks={self.ks} must lie in 1..n_samples={self.n_samples}")


@dataclass(frozen=True, kw_only=True)
class EvalData:
    """Where the validation prompts come from and how they are tokenised (the run's ``data`` config)."""

    files: Sequence[str]
    max_prompt_length: int
    prompt_key: str = "prompt"
    ground_truth_key: str = "ground_truth"
    data_source_key: str = "data_source"
    apply_chat_template: bool = True
    toy_rows: int = 512
    seed: int = 0


def _score(reward_fn: Any, *, data_source: str, response: str, truth: str) -> tuple[float, float | None]:
    """``(score, correct)``; ``correct`` is the reward's ``acc`` or, with a ground truth, ``score >= 1``."""
    result = reward_fn(data_source, response, truth, None)
    if isinstance(result, Mapping):
        score = float(result["score"])
        if "acc" in result:
            return score, float(result["acc"])
    else:
        score = float(result)
    return score, (1.0 if score >= 1.0 else 0.0) if truth else None


def _score_all(generations: Sequence[Any], dataset: Any, reward_fn: Any) -> list[ScoredResponse]:
    rows = []
    for gen in generations:
        source, truth = dataset.data_sources[gen.prompt_index], dataset.ground_truths[gen.prompt_index]
        score, correct = _score(reward_fn, data_source=source, response=gen.text, truth=truth)
        rows.append(
            ScoredResponse(
                prompt_index=gen.prompt_index,
                data_source=source,
                response=gen.text,
                length=gen.length,
                score=score,
                correct=correct,
            )
        )
    return rows


def _prompt_text(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in raw or [])


def _examples(rows: Sequence[ScoredResponse], dataset: Any) -> list[dict[str, Any]]:
    """Report rows of greedy generations: prompt text, ground truth, response, score."""
    return [
        {
            "prompt": _prompt_text(dataset.raw_prompts[row.prompt_index]),
            "ground_truth": dataset.ground_truths[row.prompt_index],
            "data_source": row.data_source,
            "response": row.response,
            "score": row.score,
            "correct": row.correct,
            "length": row.length,
        }
        for row in rows
    ]


def evaluate_model(
    model_dir: str | Path,
    data: EvalData,
    *,
    reward_fn: str | Any,
    settings: EvalSettings,
) -> dict[str, Any]:
    """Generate on the first ``settings.max_prompts`` prompts of ``data`` with the model in ``model_dir``, score.

    Args:
        model_dir: HF model folder (an export of a checkpoint).
        data: Validation files and tokenisation settings.
        reward_fn: A reward function or its config name (``reward.reward_fn``: built-in or dotted path).
        settings: Sampling and reporting settings; ``settings.engine`` selects the rollout engine from
            :data:`rlhf_ops.extensions.ROLLOUT_ENGINES`, which decodes both passes (greedy, then sampled).

    Returns:
        The report: ``{"version", "model_dir", "data_files", "settings", "metrics", "examples", "per_prompt",
        "created_at"}``; ``per_prompt`` holds each prompt's greedy score and correctness, in prompt order.
    """
    from rlhf_ops.data.dataset import PromptDataset
    from rlhf_ops.evaluation.generate import build_eval_engine, generate, load_tokenizer
    from rlhf_ops.rewards import load_reward_fn

    score_fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
    tokenizer = load_tokenizer(str(model_dir))
    engine, context = build_eval_engine(
        settings.engine,
        str(model_dir),
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        dtype=settings.dtype,
    )
    dataset = PromptDataset.from_sources(
        list(data.files),
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        prompt_key=data.prompt_key,
        ground_truth_key=data.ground_truth_key,
        data_source_key=data.data_source_key,
        apply_chat_template=data.apply_chat_template,
        toy_rows=data.toy_rows,
        seed=data.seed,
    )
    indices = list(range(min(settings.max_prompts, len(dataset))))

    def run(n: int, do_sample: bool) -> list[Any]:
        kw: dict[str, Any] = {
            "n": n,
            "do_sample": do_sample,
            "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
        }
        return generate(
            engine,
            tokenizer,
            dataset,
            indices,
            batch_size=settings.batch_size,
            device=context.device,
            eos_token_id=context.eos_token_id,
            **kw,
        )

    greedy = _score_all(run(1, False), dataset, score_fn)
    metrics = greedy_metrics(greedy)
    sampled: list[ScoredResponse] = []
    if settings.n_samples:
        sampled = _score_all(run(settings.n_samples, True), dataset, score_fn)
        ks = list(settings.ks) or default_ks(settings.n_samples)
        metrics.update(sample_metrics(sampled, n=settings.n_samples, ks=ks))
    examples = _examples(greedy[: settings.num_examples], dataset)
    # Per-prompt greedy results, in prompt order: a later report on the same prompts can then be
    # compared prompt by prompt (rlhf_ops.evaluation.paired) instead of as two independent means.
    per_prompt = [
        {
            "index": row.prompt_index,
            "score": row.score,
            "correct": row.correct,
            "length": row.length,
            **_sample_means(sampled, row.prompt_index),
        }
        for row in greedy
    ]
    log.info("evaluated %s on %d prompts: %s", model_dir, len(indices), metrics)
    return {
        "version": REPORT_VERSION,
        "model_dir": str(model_dir),
        "data_files": list(data.files),
        "settings": {**asdict(settings), "ks": list(settings.ks)},
        "metrics": {k: (v if math.isfinite(v) else None) for k, v in metrics.items()},
        "examples": examples,
        "per_prompt": per_prompt,
        "eval_set": eval_set_fingerprint(dataset, indices),
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _sample_means(sampled: Sequence[ScoredResponse], index: int) -> dict[str, float]:
    """Mean score and accuracy of the sampled responses of prompt ``index`` (empty when nothing was sampled)."""
    rows = [r for r in sampled if r.prompt_index == index]
    if not rows:
        return {}
    out = {"sample_score": sum(r.score for r in rows) / len(rows)}
    checked = [r.correct for r in rows if r.correct is not None]
    if checked:
        out["sample_acc"] = sum(checked) / len(checked)
    return out


def eval_set_fingerprint(dataset: Any, indices: Sequence[int]) -> dict[str, Any]:
    """``{"sha256", "num_prompts"}`` over the evaluated prompts and answers: reports are paired only when equal."""
    digest = hashlib.sha256()
    for i in indices:
        row = [i, dataset.raw_prompts[i], dataset.ground_truths[i], dataset.data_sources[i]]
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return {"sha256": digest.hexdigest(), "num_prompts": len(indices)}


def ensure_export(
    ckpt_dir: Path, export_dir: Path, *, base_model_path: str, tokenizer_path: str | None = None
) -> Path:
    """The HF folder of a checkpoint: its own ``hf/`` (``trainer.save_hf_model``), a previous export, or a new one."""
    from rlhf_ops.checkpoint.export import EXPORT_INFO_FILE, export_hf_model

    own = ckpt_dir / "hf"
    if (own / "config.json").is_file():
        return own
    if (export_dir / EXPORT_INFO_FILE).is_file():  # the export appears atomically: complete when it exists
        return export_dir
    return export_hf_model(ckpt_dir, export_dir, base_model_path=base_model_path, tokenizer_path=tokenizer_path)


def log_eval_to_mlflow(report: Mapping[str, Any], *, run_id: str, step: int, tracking_uri: str | None = None) -> None:
    """Log the report's metrics at ``step``, the report as an artifact, and its examples as a table.

    A retry logs the metrics again (MLflow keeps both points at the step) and skips an existing table.
    """
    from mlflow import MlflowClient

    from rlhf_ops.tracking.artifacts import generations_artifact, log_eval_report, log_generations
    from rlhf_ops.tracking.mlflow_tracking import MlflowLogger

    logger = MlflowLogger(run_id, tracking_uri=tracking_uri, log_system_metrics=False)
    try:
        metrics = {k: v for k, v in (report.get("metrics") or {}).items() if v is not None}
        logger.log_metrics(metrics, step=step)
        log_eval_report(logger, report, step=step)
        table = generations_artifact(step)
        existing = {a.path for a in MlflowClient(tracking_uri=tracking_uri).list_artifacts(run_id, "generations")}
        if table not in existing and report.get("examples"):
            log_generations(logger, [{"step": step, **row} for row in report["examples"]], step=step)
    finally:
        logger.close()
