"""The trigger form: one JSON-Schema ``Param`` per pipeline parameter (rendered by the Airflow UI).

A value that breaks the schema is refused by the form and by the REST API before a run exists; values the
schema cannot judge (a config override, a combination of settings) fail at ``preflight`` with the config's
message. The enums mirror the library (``rlhf_ops.config.list_presets()`` and the ``adv_estimator``
literal); ``tests/unit/dags`` checks that they stay equal, since a DAG file must not import the library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import Param

PRESETS = ["qwen2.5-0.5b-grpo-gpu", "qwen2.5-7b-ppo-gpu", "smollm2-135m-grpo-cpu", "tiny-cpu", "tiny-vlm-cpu"]
ALGORITHMS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
PROMOTION_METRICS = ["eval/acc", "eval/mean_acc", "eval/reward/mean", "eval/sample/reward/mean"]
DATA_FIELDS = ["prompt", "ground_truth", "data_source", "extra_info"]
_MODEL, _DATA, _TRAIN, _STORE, _EVAL = "Model", "Data", "Training", "Storage and cluster", "Evaluation and registry"


def _nullable(kind: str, **schema: Any) -> dict[str, Any]:
    return {"type": ["null", kind], **schema}


# name: (default, form section, description, JSON-Schema keywords)
PARAM_SPECS: dict[str, tuple[Any, str, str, dict[str, Any]]] = {
    "preset": ("tiny-cpu", _MODEL, "Shipped config preset.", {"type": "string", "enum": PRESETS}),
    "model_path": (
        None,
        _MODEL,
        "Local HF model folder on the shared path; empty: the preset's.",
        _nullable("string", minLength=1),
    ),
    "dataset_url": (
        None,
        _DATA,
        "Raw data: JSONL / Parquet / HF datasets folder (any fsspec URL) or builtin:<toy task>; empty: the preset's.",
        _nullable("string", minLength=1),
    ),
    "val_dataset_url": (
        None,
        _DATA,
        "Separate validation rows; empty: hash val_fraction of dataset_url.",
        _nullable("string", minLength=1),
    ),
    "val_fraction": (
        0.05,
        _DATA,
        "Share of prompts held out for validation.",
        {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    ),
    "field_map": (
        {},
        _DATA,
        'Our column -> the source\'s column or dotted path, e.g. {"prompt": "question"}.',
        {
            "type": "object",
            "propertyNames": {"enum": DATA_FIELDS},
            "additionalProperties": {"type": "string", "minLength": 1},
        },
    ),
    "max_rejected_fraction": (
        0.1,
        _DATA,
        "prepare_data fails when a larger share of rows is rejected.",
        {"type": "number", "minimum": 0, "maximum": 1},
    ),
    "algorithm": (
        None,
        _TRAIN,
        "Advantage estimator; empty: the preset's.",
        _nullable("string", enum=[None, *ALGORITHMS]),
    ),
    "total_training_steps": (
        None,
        _TRAIN,
        "Stop after this many steps; empty: the preset's.",
        _nullable("integer", minimum=1),
    ),
    "save_freq": (
        None,
        _TRAIN,
        "Checkpoint (and evaluate) every N steps; empty: the preset's.",
        _nullable("integer", minimum=0),
    ),
    "learning_rate": (
        None,
        _TRAIN,
        "actor.optim.lr; empty: the preset's.",
        _nullable("number", exclusiveMinimum=0),
    ),
    "use_kl_loss": (None, _TRAIN, "KL(actor || ref) as a loss term; empty: the preset's.", _nullable("boolean")),
    "kl_coef": (
        None,
        _TRAIN,
        "KL weight (loss coefficient and in-reward beta); empty: the preset's.",
        _nullable("number", minimum=0),
    ),
    "rollout_n": (None, _TRAIN, "Samples per prompt; empty: the preset's.", _nullable("integer", minimum=1)),
    "overrides": (
        [],
        _TRAIN,
        "Dotted config overrides, e.g. rollout.temperature=0.7 (rlhf config show).",
        {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_.]*=.*$"}},
    ),
    "remote_store_url": (
        None,
        _STORE,
        "Checkpoint store: file://, s3://, hdfs://, webhdfs://; empty: none.",
        _nullable("string", pattern="^(file|s3|hdfs|webhdfs)://.+"),
    ),
    "ray_address": (
        None,
        _STORE,
        "Ray dashboard URL (http://host:8265); empty: the ray_default connection.",
        _nullable("string", pattern="^https?://.+"),
    ),
    "work_dir": (
        None,
        _STORE,
        "Shared folder for data, checkpoints and exports; empty: $RLHF_WORK_DIR.",
        _nullable("string", minLength=1),
    ),
    "keep_last": (
        2,
        _STORE,
        "Checkpoints kept after the run besides the best; 0 keeps all.",
        {"type": "integer", "minimum": 0},
    ),
    "eval_n_samples": (
        4,
        _EVAL,
        "Sampled responses per prompt for pass@k; 0: greedy only.",
        {"type": "integer", "minimum": 0, "maximum": 64},
    ),
    "eval_max_prompts": (
        128,
        _EVAL,
        "Validation prompts evaluated per checkpoint.",
        {"type": "integer", "minimum": 1},
    ),
    "eval_metric": (
        "eval/reward/mean",
        _EVAL,
        "Eval metric (higher is better) that picks the best checkpoint.",
        {"type": "string", "pattern": "^eval/.+"},
    ),
    "promotion": (
        {},
        _EVAL,
        "Paired test a checkpoint must win to replace an earlier one or the champion: "
        '{"metric": "eval/acc", "min_gain": 0.0, "confidence": 0.95, "method": "bootstrap"}; '
        "missing keys take these defaults.",
        {
            "type": "object",
            "properties": {
                "metric": _nullable("string", enum=[None, *PROMOTION_METRICS]),
                "min_gain": {"type": "number", "minimum": 0, "maximum": 1},
                "confidence": {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 1},
                "method": {"type": "string", "enum": ["bootstrap", "wald"]},
                "resamples": {"type": "integer", "minimum": 1000, "maximum": 100000},
                "seed": {"type": "integer"},
            },
            "additionalProperties": False,
        },
    ),
    "registered_model_name": (
        None,
        _EVAL,
        "MLflow registered model; empty: <dag_id>-<preset>.",
        _nullable("string", pattern="^[A-Za-z0-9][A-Za-z0-9_.-]*$"),
    ),
    "warm_start": (
        "scratch",
        _EVAL,
        "Start from the preset's model, or from the registered champion.",
        {"type": "string", "enum": ["scratch", "champion"]},
    ),
    "mlflow_experiment": (
        None,
        _EVAL,
        "MLflow experiment; empty: the preset's.",
        _nullable("string", minLength=1),
    ),
}


def pipeline_params(defaults: Mapping[str, Any] | None = None) -> dict[str, Param]:
    """The pipeline's ``Param``s; ``defaults`` (from a YAML spec) replace the default values.

    Raises:
        ValueError: ``defaults`` names an unknown parameter.
    """
    d = dict(defaults or {})
    unknown = sorted(set(d) - set(PARAM_SPECS))
    if unknown:
        raise ValueError(f"unknown pipeline parameter(s) {unknown}; known: {sorted(PARAM_SPECS)}")
    return {
        name: Param(d.get(name, default), description=description, section=section, **extra)
        for name, (default, section, description, extra) in PARAM_SPECS.items()
    }
