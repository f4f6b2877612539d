"""The trigger form users see stays as it was, and the form and the library judge values alike.

``EXPECTED`` is the form as it was written by hand before it was generated from
``rlhf_ops.pipeline.params.PipelineParams``: every name, default, section, description and JSON-Schema
keyword. A change to the library's schema that changes the form fails here (update both on purpose).
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rlhf_ops.config import list_presets
from rlhf_ops.pipeline.params import PipelineParams

PRESETS = list_presets()
ALGORITHMS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
PROMOTION_METRICS = ["eval/acc", "eval/mean_acc", "eval/reward/mean", "eval/sample/reward/mean"]
DATA_FIELDS = ["prompt", "ground_truth", "data_source", "extra_info"]
_MODEL, _DATA, _TRAIN, _STORE, _EVAL = "Model", "Data", "Training", "Storage and cluster", "Evaluation and registry"


def _nullable(kind: str, **schema: Any) -> dict[str, Any]:
    return {"type": ["null", kind], **schema}


# name: (default, form section, description, JSON-Schema keywords)
EXPECTED: dict[str, tuple[Any, str, str, dict[str, Any]]] = {
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
        'Our column -> the source\'s column or dotted path, then named transforms after "|", e.g. '
        '{"prompt": "question", "ground_truth": "answer|gsm8k_final_answer"} (gsm8k_final_answer, '
        "math_last_boxed, strip, template:<text with {}>).",
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
    "max_train_minutes": (
        None,
        _TRAIN,
        "Time budget: end training before a step would finish past this many minutes from the job's start, as an "
        "early stop that evaluates what it saved (trainer.early_stop.max_time_s); empty: none.",
        _nullable("number", exclusiveMinimum=0),
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
        "Checkpoint store: file://, s3://, hdfs://, webhdfs:// or any installed fsspec protocol "
        "(gs://, abfs://...); empty: none.",
        _nullable("string", pattern="^[A-Za-z][A-Za-z0-9+.-]*://.+"),
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
    "code": (
        {},
        _STORE,
        "Code shipped with the run (Ray runtime_env): {working_dir, py_modules: [...], pip: [...]}; only what the "
        "spec's allowed_code allows.",
        {"type": "object", "additionalProperties": True},
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
    "eval_engine": (
        "auto",
        _EVAL,
        "Generation engine of the evaluations (a Ray job each): vllm (batched), hf (CPU fallback); "
        "auto: the run's rollout.engine.",
        {"type": "string", "enum": ["auto", "hf", "vllm", "sglang"]},  # auto + the rollout engine table
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


def test_the_generated_form_is_the_form_users_had() -> None:
    from rlhf_airflow.pipeline.params import PARAM_SPECS

    assert list(PARAM_SPECS) == list(EXPECTED)  # same names, same order (the UI renders them in order)
    for name, spec in EXPECTED.items():
        assert PARAM_SPECS[name] == spec, name


def test_every_param_is_the_same_airflow_param() -> None:
    from airflow.sdk import Param

    from rlhf_airflow.pipeline.params import pipeline_params

    params = pipeline_params()
    for name, (default, section, description, extra) in EXPECTED.items():
        want = Param(default, description=description, section=section, **extra)
        assert params[name].dump() == want.dump(), name
        assert "title" not in params[name].schema, name  # the form shows the parameter's name


# (name, value): values the form and the library must both accept, or both refuse.
CASES = [
    ("preset", "tiny-cpu"),
    ("preset", "gpt-5"),
    ("preset", ""),
    ("model_path", None),
    ("model_path", ""),
    ("model_path", "/models/x"),
    ("val_fraction", 0.0),
    ("val_fraction", 1.0),
    ("field_map", {"prompt": "question"}),
    ("field_map", {"question": "prompt"}),
    ("field_map", {"prompt": ""}),
    ("field_map", {"ground_truth": "answer|gsm8k_final_answer"}),
    ("max_rejected_fraction", 1.0),
    ("max_rejected_fraction", 1.5),
    ("algorithm", None),
    ("algorithm", "rloo"),
    ("algorithm", "dpo"),
    ("total_training_steps", 0),
    ("total_training_steps", 1),
    ("save_freq", 0),
    ("save_freq", -1),
    ("max_train_minutes", 0),
    ("max_train_minutes", 90.5),
    ("learning_rate", 0.0),
    ("learning_rate", 1e-5),
    ("use_kl_loss", True),
    ("kl_coef", -0.1),
    ("kl_coef", 0.0),
    ("rollout_n", 0),
    ("rollout_n", 4),
    ("overrides", ["rollout.temperature=0.7"]),
    ("overrides", ["no equals sign"]),
    ("remote_store_url", "s3://bucket/x"),
    ("remote_store_url", "ftp://host/x"),
    ("remote_store_url", "gs://bucket/x"),
    ("remote_store_url", "no scheme"),
    ("ray_address", "http://ray:8265"),
    ("ray_address", "ray://ray:10001"),
    ("work_dir", ""),
    ("keep_last", -1),
    ("keep_last", 0),
    ("eval_n_samples", 64),
    ("eval_n_samples", 65),
    ("eval_max_prompts", 0),
    ("eval_metric", "eval/acc"),
    ("eval_metric", "acc"),
    ("promotion", {"metric": "eval/acc", "min_gain": 0.05}),
    ("promotion", {"metric": "acc"}),
    ("promotion", {"confidence": 1.5}),
    ("promotion", {"unknown": 1}),
    ("registered_model_name", "my-model.v1"),
    ("registered_model_name", "-bad"),
    ("warm_start", "champion"),
    ("warm_start", "yesterday"),
    ("mlflow_experiment", ""),
]


@pytest.mark.parametrize(("name", "value"), CASES)
def test_the_form_and_the_library_agree_on_a_value(name: str, value: Any) -> None:
    from airflow.sdk.definitions.param import ParamValidationError

    from rlhf_airflow.pipeline.params import pipeline_params

    try:
        pipeline_params()[name].resolve(value)
        form_ok = True
    except ParamValidationError:
        form_ok = False
    try:
        PipelineParams.model_validate({name: value})
        library_ok = True
    except ValidationError:
        library_ok = False
    assert form_ok == library_ok, f"{name}={value!r}: form accepts {form_ok}, library accepts {library_ok}"
