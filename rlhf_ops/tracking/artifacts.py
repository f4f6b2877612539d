"""Where each pipeline artifact lives in a run, and helpers that write it through any ``MetricLogger``.

Layout of a run's artifacts (one place to change it)::

    config/resolved_config.yaml        resolved config, secrets redacted
    data/manifest.json                 prepare_data's manifest
    data/rejected_sample.jsonl         first rows rejected by prepare_data (with the reason)
    eval/report_step_<N:06d>.json      one eval report per evaluated checkpoint
    generations/step_<N:06d>.json      sample generations table (MLflow table JSON)
    params_overflow.json               param values longer than MLflow's limit
    model/                             final HF export as an MLflow Model (MlflowLogger.log_mlflow_model)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_ops.tracking.logger import MetricLogger
from rlhf_ops.tracking.params import redact_config

CONFIG_ARTIFACT = "config/resolved_config.yaml"
DATA_MANIFEST_ARTIFACT = "data/manifest.json"
REJECTED_SAMPLE_ARTIFACT = "data/rejected_sample.jsonl"


def eval_report_artifact(step: int) -> str:
    """Artifact path of the eval report of global step ``step``."""
    return f"eval/report_step_{step:06d}.json"


def generations_artifact(step: int) -> str:
    """Artifact path of the sample generations table of global step ``step``."""
    return f"generations/step_{step:06d}.json"


def log_resolved_config(logger: MetricLogger, config: Mapping[str, Any] | Any) -> None:
    """Log the resolved config as YAML (secrets redacted); pydantic models are dumped in JSON mode."""
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    logger.log_dict(redact_config(config), CONFIG_ARTIFACT)


def log_data_manifest(logger: MetricLogger, manifest: Mapping[str, Any]) -> None:
    """Log prepare_data's manifest (credentials in source URLs masked)."""
    logger.log_dict(redact_config(manifest), DATA_MANIFEST_ARTIFACT)


def log_rejected_sample(logger: MetricLogger, rows: Sequence[Mapping[str, Any]], *, max_rows: int = 100) -> int:
    """Log the first ``max_rows`` rejected rows as JSONL; returns how many were written."""
    if max_rows < 0:
        raise ValueError(f"log_rejected_sample: max_rows must be >= 0, got {max_rows}")
    sample = list(rows[:max_rows])
    # Rows are user data: URL passwords and token shapes in them are masked like every other artifact.
    text = "".join(json.dumps(redact_config(dict(r)), default=str, ensure_ascii=False) + "\n" for r in sample)
    logger.log_text(text, REJECTED_SAMPLE_ARTIFACT)
    return len(sample)


def log_eval_report(logger: MetricLogger, report: Mapping[str, Any], *, step: int) -> None:
    """Log one eval report (JSON) under ``eval/``."""
    logger.log_dict(report, eval_report_artifact(step))


def log_generations(logger: MetricLogger, rows: Sequence[Mapping[str, Any]], *, step: int) -> None:
    """Log sample generations (e.g. ``{"prompt", "response", "score"}`` rows) as a table under ``generations/``."""
    logger.log_table(rows, generations_artifact(step))
