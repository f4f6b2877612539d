"""The ``prepare_data`` task: raw rows → ``<work>/data/<dag_id>/<run_key>/`` (train/val Parquet, rejected rows).

It runs before ``preflight``, so it reads only the data keys of the preset + form + overrides, without
validating the whole config (a bad value elsewhere fails at ``preflight`` with the config's message). The
tokenizer is the policy's, so token counts match the trainer's. A retry rewrites the same files.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rlhf_ops.config import apply_overrides, read_preset
from rlhf_ops.config.schema import DataConfig, TrainerConfig
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.params import PipelineParams, param_overrides

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"


def _value(section: Mapping[str, Any], key: str, model: type[DataConfig] | type[TrainerConfig]) -> Any:
    """``section[key]`` or the schema's default."""
    return section[key] if key in section else model.model_fields[key].default


def data_settings(params: PipelineParams) -> dict[str, Any]:
    """The data keys of the (not yet validated) config: sources, tokenizer, length limit, seed."""
    raw = apply_overrides(read_preset(params.preset), [*param_overrides(params), *params.overrides])
    data, trainer, model = raw.get("data") or {}, raw.get("trainer") or {}, raw.get("model") or {}
    train_files = list(data.get("train_files") or [])
    source = params.dataset_url
    if source is None:
        if len(train_files) != 1:
            raise ValueError(
                f"preset {params.preset!r} has {len(train_files)} data.train_files; set dataset_url to the one "
                "raw source to prepare"
            )
        source = train_files[0]
    val_source = params.val_dataset_url
    if val_source is None and params.dataset_url is None and data.get("val_files"):
        val_source = data["val_files"][0]  # the preset's own validation set
    model_path = model.get("path")
    if not model_path:
        raise ValueError("model.path is not set by the preset; set params.model_path")
    return {
        "source": source,
        "val_source": val_source,
        "tokenizer": model.get("tokenizer_path") or model_path,
        "max_prompt_length": int(_value(data, "max_prompt_length", DataConfig)),
        "apply_chat_template": bool(_value(data, "apply_chat_template", DataConfig)),
        "toy_rows": int(_value(data, "toy_rows", DataConfig)),
        "seed": int(_value(trainer, "seed", TrainerConfig)),
    }


def prepare_for_run(
    params: PipelineParams, layout: RunLayout, *, override_policy: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Prepare this run's data; returns :class:`~rlhf_ops.data.prepare.PrepareResult` as a dict.

    ``override_policy``: the DAG's :class:`~rlhf_ops.pipeline.override_policy.OverridePolicy` (as a dict), checked
    before any data is read (the form's ``overrides`` steer what this task reads, e.g. ``data.train_files``).

    Raises:
        ConfigError: an override the form may not set.
        ValueError: a bad source or field map, or (``DataQualityError``) too many rejected rows.
    """
    from rlhf_ops.config import ConfigError
    from rlhf_ops.pipeline.override_policy import OverridePolicy

    refused = OverridePolicy.from_dict(override_policy).problems(params.overrides)
    if refused:
        raise ConfigError(refused)
    from rlhf_ops.data.images import load_tokenizer_or_processor
    from rlhf_ops.data.prepare import PrepareSpec, prepare_dataset
    from rlhf_ops.models.resolve import resolve_model_path

    settings = data_settings(params)
    builtin = str(settings["source"]).startswith(BUILTIN_PREFIX)
    spec = PrepareSpec(
        source=settings["source"],
        val_source=settings["val_source"],
        field_map=dict(params.field_map),
        apply_chat_template=settings["apply_chat_template"],
        max_prompt_length=settings["max_prompt_length"],
        val_fraction=params.val_fraction,
        seed=settings["seed"],
        max_rejected_fraction=params.max_rejected_fraction,
        limit=settings["toy_rows"] if builtin else None,
    )
    # A vision-language model's processor: image rows are checked and their image tokens counted.
    tokenizer = load_tokenizer_or_processor(resolve_model_path(settings["tokenizer"]))
    result = prepare_dataset(spec, out_url=layout.data_root, run_id=layout.run_key, tokenizer=tokenizer)
    log.info(
        "prepared %s: %d train, %d val, %d rejected",
        result.run_url,
        result.num_train,
        result.num_val,
        result.num_rejected,
    )
    return result.model_dump(mode="json")
