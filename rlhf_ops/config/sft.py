"""``rlhf sft``: the config of supervised fine-tuning on chat conversations (an SFT warm-up before RL).

One typed, frozen config like :class:`~rlhf_ops.config.schema.RunConfig`: a preset (a shipped name under
``rlhf_ops/config/sft_presets/`` or a YAML path) plus dotted overrides, every problem one line naming the key
and the fix. The optimizer and tracking sections are the RL run's own (:class:`OptimConfig`,
:class:`TrackingConfig`), so an SFT run and the RL run after it read the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError

from rlhf_ops.config.errors import ConfigError, ConfigProblem, from_validation_error
from rlhf_ops.config.loader import apply_overrides
from rlhf_ops.config.multi_turn import BUILTIN_TOOL_NAMES, _spec_problem
from rlhf_ops.config.schema import OptimConfig, TrackingConfig
from rlhf_ops.config.section import DType, Section

# SFT runs outside Ray (torchrun or one process), where Ray's metrics have no agent: no "prometheus".
SFTLoggerName = Literal["console", "jsonl", "mlflow"]


def _default_sft_loggers() -> list[SFTLoggerName]:
    return ["console", "jsonl"]


SFT_PRESET_PACKAGE = "rlhf_ops.config.sft_presets"
SFT_BUILTIN_SOURCES = ("builtin:calculator_sft",)


class SFTModelConfig(Section):
    """The model to fine-tune."""

    path: str = Field(..., min_length=1, description="HF model folder or builtin: model (as model.path of RL).")
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; None uses path.")
    dtype: DType = Field("float32", description="Weights while training and on disk.")


class SFTDataConfig(Section):
    """The conversations and how their prompts describe the tools (as ``rollout.multi_turn`` does)."""

    train_files: list[str] = Field(
        ...,
        min_length=1,
        description="JSONL / Parquet files of rows {'messages': [...]} (OpenAI chat, 'tool' results), or "
        "builtin:calculator_sft (synthetic calculator transcripts, rlhf_ops/data/tool_sft.py).",
    )
    num_rows: int = Field(400, gt=0, le=100_000, description="Rows generated for a builtin: source.")
    seed: int = Field(0, description="Seed of a builtin: source's generator.")
    max_length: int = Field(512, gt=8, description="Most tokens per conversation; longer ones are refused.")
    tools: list[str] = Field(
        default_factory=list,
        description="Tools described in each prompt, as rollout.multi_turn.tools of the RL run (e.g. [calculator]).",
    )
    tool_prompt: Literal["schemas", "example"] = Field(
        "schemas", description="As rollout.multi_turn.tool_prompt: set it to the RL run's value."
    )


class SFTTrainerConfig(Section):
    """Epochs, batching, output."""

    output_dir: str = Field(..., min_length=1, description="The HF model folder written at the end (atomically).")
    overwrite: bool = Field(False, description="Replace output_dir if it exists.")
    epochs: int = Field(1, gt=0, description="Passes over the conversations.")
    micro_batch_size: int = Field(4, gt=0, description="Conversations per forward / backward.")
    grad_accum_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    seed: int = Field(0, description="Seed of the shuffle and of torch.")
    num_threads: int | None = Field(None, gt=0, description="torch threads; None = the machine's cores.")
    logger: list[SFTLoggerName] = Field(default_factory=_default_sft_loggers)
    metrics_file: str | None = Field(None, description="JSONL of the metrics; None = <output_dir>.metrics.jsonl.")


class SFTOptimConfig(OptimConfig):
    """The RL actor's optimizer section, with SFT's usual defaults (lr 1e-5, no weight decay)."""

    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0)


class SFTTrackingConfig(TrackingConfig):
    """MLflow (``trainer.logger`` lists ``mlflow``): the RL run's section, in its own experiment by default."""

    experiment: str = Field("rlhf-sft", min_length=1)


class SFTConfig(Section):
    """One SFT run, fully resolved."""

    model: SFTModelConfig
    data: SFTDataConfig
    optim: SFTOptimConfig = Field(default_factory=SFTOptimConfig)
    trainer: SFTTrainerConfig
    tracking: SFTTrackingConfig = Field(default_factory=SFTTrackingConfig)


def sft_problems(cfg: SFTConfig) -> list[ConfigProblem]:
    """Cross-field problems (empty when consistent)."""
    problems = [p for s in cfg.data.tools if (p := _spec_problem("data.tools", s, BUILTIN_TOOL_NAMES))]
    if "python" in cfg.data.tools:
        problems.append(
            ConfigProblem("data.tools", "'python' is built by the Ray workers only", "describe it by a dotted path")
        )
    if cfg.data.tool_prompt == "example" and not cfg.data.tools:
        problems.append(ConfigProblem("data.tool_prompt", "'example' needs tools", "set data.tools or 'schemas'"))
    for source in cfg.data.train_files:
        if source.startswith("builtin:") and source not in SFT_BUILTIN_SOURCES:
            problems.append(
                ConfigProblem("data.train_files", f"unknown built-in {source!r}", f"use one of {SFT_BUILTIN_SOURCES}")
            )
    if "builtin:calculator_sft" in cfg.data.train_files and "calculator" not in cfg.data.tools:
        problems.append(
            ConfigProblem(
                "data.tools",
                "builtin:calculator_sft calls the calculator, which the prompts do not describe",
                "add calculator to data.tools",
            )
        )
    return problems


def list_sft_presets() -> list[str]:
    """Names of the shipped SFT presets."""
    files = resources.files(SFT_PRESET_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def _read(preset: str | None) -> dict[str, object]:
    if preset is None:
        return {}
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = path.read_text()
    else:
        candidate = resources.files(SFT_PRESET_PACKAGE).joinpath(f"{preset}.yaml")
        if not candidate.is_file():
            fix = f"use one of {list_sft_presets()} or a YAML path"
            raise ConfigError([ConfigProblem("preset", f"unknown SFT preset {preset!r}", fix)])
        text = candidate.read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("preset", f"{preset} is not a mapping", "write key: value pairs")])
    return data


def load_sft_config(preset: str | None, overrides: Sequence[str] = ()) -> SFTConfig:
    """The validated SFT config of ``preset`` (None: overrides only) with ``overrides`` applied.

    Raises:
        ConfigError: with every problem (one line each: key, what is wrong, the fix).
    """
    data = apply_overrides(_read(preset), overrides, verl_names=False)
    try:
        cfg = SFTConfig.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, SFTConfig) from None
    problems = sft_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
