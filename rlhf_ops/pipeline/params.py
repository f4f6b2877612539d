"""The pipeline's run parameters (the Airflow trigger form) and the config overrides they imply.

Airflow validates the form against the DAG's JSON-Schema ``Param``s (``dags/rlhf_pipeline/params.py``);
:class:`PipelineParams` is the typed view the library works with (a second check for runs created by code).
The resolved config is, in order of precedence (later wins)::

    preset  <  values of the form (model_path, algorithm, learning_rate…)  <  overrides (dotted strings)
            <  what the pipeline owns: checkpoint folder and run name keyed by the Airflow run id, the
               prepared data files, the MLflow logger, keep_last=0 (retention is the pipeline's job) and
               resume_mode=auto (a retried training task resumes)
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.promotion import PromotionSpec

TRAIN_MODULE = "rlhf_ops.entrypoints.train"


class PipelineParams(BaseModel):
    """One pipeline run's parameters; ``None`` keeps the preset's value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str = Field("tiny-cpu", min_length=1, description="Shipped preset name.")
    model_path: str | None = Field(None, description="model.path: local HF folder or builtin:tiny-llama.")
    dataset_url: str | None = Field(
        None, description="Raw data (JSONL/Parquet/HF folder/builtin:<task>); None: preset's."
    )
    val_dataset_url: str | None = Field(None, description="Separate validation rows; None: split off dataset_url.")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of prompts hashed into validation.")
    field_map: dict[str, str] = Field(default_factory=dict, description="Our column -> source column.")
    max_rejected_fraction: float = Field(0.1, ge=0.0, le=1.0, description="prepare_data fails above this share.")
    algorithm: str | None = Field(None, description="algorithm.adv_estimator.")
    total_training_steps: int | None = Field(None, gt=0)
    save_freq: int | None = Field(None, ge=0, description="Checkpoint (and evaluate) every N steps.")
    learning_rate: float | None = Field(None, gt=0.0, description="actor.optim.lr.")
    use_kl_loss: bool | None = Field(None, description="algorithm.use_kl_loss.")
    kl_coef: float | None = Field(None, ge=0.0, description="KL weight: kl_loss_coef and kl_ctrl.kl_coef.")
    rollout_n: int | None = Field(None, gt=0, description="rollout.n.")
    remote_store_url: str | None = Field(None, description="trainer.remote_store_url (file://, s3://, hdfs://…).")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides, e.g. rollout.temperature=0.7.")
    ray_address: str | None = Field(None, description="Ray dashboard URL; None: the ray_default connection.")
    work_dir: str | None = Field(None, description="Shared work folder; None: $RLHF_WORK_DIR.")
    keep_last: int = Field(2, ge=0, description="Checkpoints kept after the run (plus the best); 0 keeps all.")
    eval_n_samples: int = Field(4, ge=0, description="Sampled responses per prompt for pass@k (0: greedy only).")
    eval_max_prompts: int = Field(128, gt=0, description="Validation prompts evaluated per checkpoint.")
    eval_metric: str = Field("eval/reward/mean", min_length=1, description="Picks the best checkpoint.")
    promotion: PromotionSpec = Field(
        default_factory=PromotionSpec,
        description="Paired test a checkpoint must win (metric, min_gain, confidence, method).",
    )
    registered_model_name: str | None = Field(None, description="MLflow registered model; None: <dag_id>-<preset>.")
    warm_start: Literal["scratch", "champion"] = Field("scratch", description="Start from the champion model.")
    mlflow_experiment: str | None = Field(None, description="tracking.experiment; None: the preset's.")

    def registered_name(self, dag_id: str) -> str:
        """The registered model name of this pipeline."""
        return self.registered_model_name or f"{dag_id}-{self.preset}"


def format_override(key: str, value: Any) -> str:
    """``key=value`` with the value as JSON, which the config loader parses as YAML (JSON is YAML)."""
    return f"{key}={json.dumps(value)}"


def param_overrides(params: PipelineParams) -> list[str]:
    """Overrides from the form's typed fields (before the user's free-form ``overrides``)."""
    pairs: list[tuple[str, Any]] = [
        ("model.path", params.model_path),
        ("algorithm.adv_estimator", params.algorithm),
        ("trainer.total_training_steps", params.total_training_steps),
        ("trainer.save_freq", params.save_freq),
        ("actor.optim.lr", params.learning_rate),
        ("algorithm.use_kl_loss", params.use_kl_loss),
        ("algorithm.kl_loss_coef", params.kl_coef),
        ("algorithm.kl_ctrl.kl_coef", params.kl_coef),
        ("rollout.n", params.rollout_n),
        ("trainer.remote_store_url", params.remote_store_url),
        ("tracking.experiment", params.mlflow_experiment),
    ]
    return [format_override(key, value) for key, value in pairs if value is not None]


def run_overrides(
    layout: RunLayout, *, train_url: str, val_url: str | None, model_path: str | None = None
) -> list[str]:
    """Overrides the pipeline owns (last, so nothing can move the run folder off the Airflow run id)."""
    pairs: list[tuple[str, Any]] = [
        ("trainer.checkpoint_root", layout.checkpoint_root),
        ("trainer.experiment_name", layout.experiment),
        ("trainer.run_name", layout.run_key),
        ("trainer.keep_last", 0),
        ("trainer.resume_mode", "auto"),
        ("trainer.logger", ["console", "jsonl", "mlflow"]),
        ("data.train_files", [train_url]),
        ("data.val_files", [val_url] if val_url else []),
    ]
    if model_path is not None:
        pairs.append(("model.path", model_path))
    return [format_override(key, value) for key, value in pairs]


def train_entrypoint(preset: str, overrides: Sequence[str]) -> str:
    """The Ray job's shell command: ``python -m rlhf_ops.entrypoints.train --preset P 'k=v'…`` (each quoted)."""
    words = ["python", "-m", TRAIN_MODULE, "--preset", preset, *overrides]
    return " ".join(shlex.quote(word) for word in words)


def parse_params(params: Mapping[str, Any]) -> PipelineParams:
    """Validate the Airflow ``params`` mapping (unknown keys are an error: a typo would be ignored otherwise)."""
    return PipelineParams.model_validate(dict(params))
