"""The pipeline's run parameters (the Airflow trigger form) and the config overrides they imply.

:class:`PipelineParams` is the one source of the form: its fields, in form order, carry the form's names,
types, defaults, descriptions, constraints and sections, and :func:`form_param_specs` turns them into the
JSON-Schema keywords of the DAG's ``Param``s (``plugins/rlhf_airflow/pipeline/params.py`` only wraps them). So the
form and the typed view the library works with (a second check for runs created by code) refuse the same
values. Importable without torch: the DAG files import it at parse time.
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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from rlhf_ops.config.loader import list_presets
from rlhf_ops.data.field_transforms import parse_field_source
from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS, ROLLOUT_ENGINES, choice_check
from rlhf_ops.fs_protocols import unknown_protocol_problem, url_scheme
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.promotion import PER_PROMPT_COLUMNS, PromotionSpec

# The training entrypoint, by module path (a command line: the library never imports workers/).
TRAIN_MODULE = "workers.entrypoints.train"

# The form's sections, in the order the UI shows them.
MODEL, DATA, TRAIN, STORE, EVAL = "Model", "Data", "Training", "Storage and cluster", "Evaluation and registry"
DataField = Literal["prompt", "ground_truth", "data_source", "extra_info"]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]
Override = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*=.*$")]


def _in(section: str, **form_only: Any) -> dict[str, Any]:
    """``json_schema_extra`` of a field: its form section (and keywords the type cannot express)."""
    return {"section": section, **form_only}


# The promotion object as the form shows it (the nested model's own schema is a $ref the form cannot render).
_PROMOTION_FORM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "metric": {"type": ["null", "string"], "enum": [None, *sorted(PER_PROMPT_COLUMNS)]},
        "min_gain": {"type": "number", "minimum": 0, "maximum": 1},
        "confidence": {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 1},
        "method": {"type": "string", "enum": ["bootstrap", "wald"]},
        "resamples": {"type": "integer", "minimum": 1000, "maximum": 100000},
        "seed": {"type": "integer"},
    },
    "additionalProperties": False,
}


class PipelineParams(BaseModel):
    """One pipeline run's parameters; ``None`` keeps the preset's value. Field order is the form's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str = Field(
        "tiny-cpu", description="Shipped config preset.", json_schema_extra=_in(MODEL, enum=list_presets())
    )
    model_path: str | None = Field(
        None,
        min_length=1,
        description="Local HF model folder on the shared path; empty: the preset's.",
        json_schema_extra=_in(MODEL),
    )
    dataset_url: str | None = Field(
        None,
        min_length=1,
        description="Raw data: JSONL / Parquet / HF datasets folder (any fsspec URL) or builtin:<toy task>; "
        "empty: the preset's.",
        json_schema_extra=_in(DATA),
    )
    val_dataset_url: str | None = Field(
        None,
        min_length=1,
        description="Separate validation rows; empty: hash val_fraction of dataset_url.",
        json_schema_extra=_in(DATA),
    )
    val_fraction: float = Field(
        0.05, ge=0, lt=1, description="Share of prompts held out for validation.", json_schema_extra=_in(DATA)
    )
    field_map: dict[DataField, NonEmpty] = Field(
        default_factory=dict,
        description='Our column -> the source\'s column or dotted path, then named transforms after "|", e.g. '
        '{"prompt": "question", "ground_truth": "answer|gsm8k_final_answer"} (gsm8k_final_answer, '
        "math_last_boxed, strip, template:<text with {}>).",
        json_schema_extra=_in(DATA),
    )
    max_rejected_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="prepare_data fails when a larger share of rows is rejected.",
        json_schema_extra=_in(DATA),
    )
    # The form lists the estimators registered when the DAG is parsed (a dotted path goes in the overrides).
    algorithm: Annotated[str, choice_check(ADVANTAGE_ESTIMATORS)] | None = Field(
        None,
        description="Advantage estimator; empty: the preset's.",
        json_schema_extra=_in(TRAIN, enum=ADVANTAGE_ESTIMATORS.names()),
    )
    total_training_steps: int | None = Field(
        None, ge=1, description="Stop after this many steps; empty: the preset's.", json_schema_extra=_in(TRAIN)
    )
    save_freq: int | None = Field(
        None,
        ge=0,
        description="Checkpoint (and evaluate) every N steps; empty: the preset's.",
        json_schema_extra=_in(TRAIN),
    )
    max_train_minutes: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Time budget: end training before a step would finish past this many minutes from the job's "
        "start, as an early stop that evaluates what it saved (trainer.early_stop.max_time_s); empty: none.",
        json_schema_extra=_in(TRAIN),
    )
    learning_rate: float | None = Field(
        None, gt=0, description="actor.optim.lr; empty: the preset's.", json_schema_extra=_in(TRAIN)
    )
    use_kl_loss: bool | None = Field(
        None, description="KL(actor || ref) as a loss term; empty: the preset's.", json_schema_extra=_in(TRAIN)
    )
    kl_coef: float | None = Field(
        None,
        ge=0,
        description="KL weight (loss coefficient and in-reward beta); empty: the preset's.",
        json_schema_extra=_in(TRAIN),
    )
    rollout_n: int | None = Field(
        None, ge=1, description="Samples per prompt; empty: the preset's.", json_schema_extra=_in(TRAIN)
    )
    overrides: list[Override] = Field(
        default_factory=list,
        description="Dotted config overrides, e.g. rollout.temperature=0.7 (rlhf config show).",
        json_schema_extra=_in(TRAIN),
    )
    remote_store_url: str | None = Field(
        None,
        pattern="^[A-Za-z][A-Za-z0-9+.-]*://.+",
        description="Checkpoint store: file://, s3://, hdfs://, webhdfs:// or any installed fsspec protocol "
        "(gs://, abfs://...); empty: none.",
        json_schema_extra=_in(STORE),
    )
    ray_address: str | None = Field(
        None,
        pattern="^https?://.+",
        description="Ray dashboard URL (http://host:8265); empty: the ray_default connection.",
        json_schema_extra=_in(STORE),
    )
    work_dir: str | None = Field(
        None,
        min_length=1,
        description="Shared folder for data, checkpoints and exports; empty: $RLHF_WORK_DIR.",
        json_schema_extra=_in(STORE),
    )
    code: dict[str, Any] = Field(
        default_factory=dict,
        description="Code shipped with the run (Ray runtime_env): {working_dir, py_modules: [...], pip: [...]}; "
        "only what the spec's allowed_code allows.",
        json_schema_extra=_in(STORE),
    )
    keep_last: int = Field(
        2,
        ge=0,
        description="Checkpoints kept after the run besides the best; 0 keeps all.",
        json_schema_extra=_in(STORE),
    )
    eval_n_samples: int = Field(
        4,
        ge=0,
        le=64,
        description="Sampled responses per prompt for pass@k; 0: greedy only.",
        json_schema_extra=_in(EVAL),
    )
    eval_max_prompts: int = Field(
        128, ge=1, description="Validation prompts evaluated per checkpoint.", json_schema_extra=_in(EVAL)
    )
    eval_engine: str = Field(
        "auto",
        description="Generation engine of the evaluations (a Ray job each): vllm (batched), hf (CPU fallback); "
        "auto: the run's rollout.engine.",
        json_schema_extra=_in(EVAL, enum=["auto", *ROLLOUT_ENGINES.names()]),
    )
    eval_metric: str = Field(
        "eval/reward/mean",
        pattern="^eval/.+",
        description="Eval metric (higher is better) that picks the best checkpoint.",
        json_schema_extra=_in(EVAL),
    )
    promotion: PromotionSpec = Field(
        default_factory=PromotionSpec,
        description="Paired test a checkpoint must win to replace an earlier one or the champion: "
        '{"metric": "eval/acc", "min_gain": 0.0, "confidence": 0.95, "method": "bootstrap"}; '
        "missing keys take these defaults.",
        json_schema_extra=_in(EVAL, form_schema=_PROMOTION_FORM),
    )
    registered_model_name: str | None = Field(
        None,
        pattern="^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="MLflow registered model; empty: <dag_id>-<preset>.",
        json_schema_extra=_in(EVAL),
    )
    warm_start: Literal["scratch", "champion"] = Field(
        "scratch",
        description="Start from the preset's model, or from the registered champion.",
        json_schema_extra=_in(EVAL),
    )
    mlflow_experiment: str | None = Field(
        None, min_length=1, description="MLflow experiment; empty: the preset's.", json_schema_extra=_in(EVAL)
    )

    @field_validator("preset")
    @classmethod
    def _shipped_preset(cls, value: str) -> str:
        presets = list_presets()
        if value not in presets:
            raise ValueError(f"preset {value!r} is not a shipped preset; choose one of {presets}")
        return value

    @field_validator("eval_engine")
    @classmethod
    def _rollout_engine(cls, value: str) -> str:
        if value != "auto" and value not in ROLLOUT_ENGINES:
            names = ROLLOUT_ENGINES.names()
            raise ValueError(f"eval_engine {value!r} is no rollout engine; choose auto or one of {names}")
        return value

    @field_validator("field_map")
    @classmethod
    def _field_transforms(cls, value: dict[str, str]) -> dict[str, str]:
        for field, text in value.items():
            parse_field_source(field, text)  # one line naming field_map.<field> and the fix
        return value

    @field_validator("remote_store_url")
    @classmethod
    def _known_protocol(cls, value: str | None) -> str | None:
        problem = value and unknown_protocol_problem(url_scheme(value))
        if problem:
            raise ValueError(f"remote_store_url: {problem}")
        return value

    def registered_name(self, dag_id: str) -> str:
        """The registered model name of this pipeline."""
        return self.registered_model_name or f"{dag_id}-{self.preset}"


def form_param_specs() -> dict[str, tuple[Any, str, str, dict[str, Any]]]:
    """``{name: (default, section, description, JSON-Schema keywords)}`` of the trigger form, in form order.

    Derived from :class:`PipelineParams`'s JSON Schema: ``X | None`` becomes ``{"type": ["null", X]}`` (an
    enum gains ``None``), and the title pydantic adds is dropped (the form shows the parameter's name).
    """
    properties = PipelineParams.model_json_schema()["properties"]
    specs: dict[str, tuple[Any, str, str, dict[str, Any]]] = {}
    for name, field in PipelineParams.model_fields.items():
        prop = dict(properties[name])
        section, description = prop.pop("section"), prop.pop("description")
        if "form_schema" in prop:  # a nested model: the form's own object schema replaces the $ref
            form_schema = prop.pop("form_schema")
            prop = {k: v for k, v in prop.items() if k not in ("$ref", "allOf")} | form_schema
        for key in ("title", "default"):
            prop.pop(key, None)
        if "anyOf" in prop:
            (kind,) = [option for option in prop.pop("anyOf") if option != {"type": "null"}]
            prop = {**kind, **prop, "type": ["null", kind["type"]]}
            if "enum" in prop:
                prop["enum"] = [None, *prop["enum"]]
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):  # a nested model's defaults: the form starts empty
            default = {}
        specs[name] = (default, section, description, prop)
    return specs


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
        ("trainer.early_stop.max_time_s", None if params.max_train_minutes is None else params.max_train_minutes * 60),
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
    """The Ray job's shell command: ``python -m workers.entrypoints.train --preset P 'k=v'…`` (each quoted)."""
    words = ["python", "-m", TRAIN_MODULE, "--preset", preset, *overrides]
    return " ".join(shlex.quote(word) for word in words)


def parse_params(params: Mapping[str, Any]) -> PipelineParams:
    """Validate the Airflow ``params`` mapping (unknown keys are an error: a typo would be ignored otherwise)."""
    return PipelineParams.model_validate(dict(params))
