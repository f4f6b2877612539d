"""The model card of an HF export: ``README.md`` with Hugging Face's YAML front matter and what made the model.

Every export carries one (``rlhf export``, the checkpoint's ``hf/``, the evaluate and register tasks): the base
model and the checkpoint it came from. The register task rewrites it with what only the pipeline knows: the
training and validation data (location and digest), the algorithm and its settings, and the evaluation metrics
of the registered checkpoint. MLflow shows the same text as the registered model's card.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_CARD_FILE = "README.md"
ALGORITHM_KEYS = ("adv_estimator", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_kl_in_reward", "gamma", "lam")


@dataclass(frozen=True, kw_only=True)
class ModelCard:
    """What a card says; empty fields print as "not recorded"."""

    base_model: str
    """The model the run started from (a local folder or ``builtin:<name>``)."""
    checkpoint: str = ""
    """The checkpoint folder exported (``.../global_step_<N>``)."""
    step: int | None = None
    """Its training step."""
    data: Mapping[str, str] = field(default_factory=dict)
    """``{"train": location, "validation": location, "sha256": digest}`` of the training data."""
    algorithm: Mapping[str, Any] = field(default_factory=dict)
    """Algorithm settings (``adv_estimator``, KL settings, learning rate...)."""
    reward: str = ""
    """The reward function."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Evaluation metrics of this checkpoint (``eval/acc``...)."""


def card_from_config(
    config: Mapping[str, Any],
    *,
    checkpoint: str = "",
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    data_sha256: str = "",
) -> ModelCard:
    """The card of a run's checkpoint from its resolved config (a ``RunConfig`` dumped to a dict)."""
    data_cfg, algorithm = config.get("data", {}), config.get("algorithm", {})
    data = {
        "train": ", ".join(str(f) for f in data_cfg.get("train_files") or []),
        "validation": ", ".join(str(f) for f in data_cfg.get("val_files") or []),
    }
    if data_sha256:
        data["sha256"] = data_sha256
    settings = {k: algorithm[k] for k in ALGORITHM_KEYS if k in algorithm}
    lr = config.get("actor", {}).get("optim", {}).get("lr")
    if lr is not None:
        settings["actor.optim.lr"] = lr
    return ModelCard(
        base_model=str(config.get("model", {}).get("path", "")),
        checkpoint=checkpoint,
        step=step,
        data=data,
        algorithm=settings,
        reward=str(config.get("reward", {}).get("reward_fn") or ""),
        metrics={k: float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)},
    )


def render_model_card(card: ModelCard) -> str:
    """The card as Markdown with YAML front matter (``library_name``, ``base_model``, ``tags``, ``datasets``)."""
    algo = str(card.algorithm.get("adv_estimator", "")).lower()
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    front.append(f"base_model: {json.dumps(card.base_model)}")
    front.append("tags: [" + ", ".join(json.dumps(t) for t in ("rlhf", "rlhf-ops", *([algo] if algo else []))) + "]")
    datasets = [v for k, v in card.data.items() if k in ("train", "validation") and v]
    if datasets:
        front.append("datasets: [" + ", ".join(json.dumps(d) for d in datasets) + "]")
    front.append("---")
    lines = [*front, "", "# Model card", "", "Fine-tuned with reinforcement learning by rlhf-ops.", ""]
    lines += ["## Base model", "", f"`{card.base_model}`", ""]
    source = f"`{card.checkpoint}`" if card.checkpoint else "not recorded"
    lines += ["## Checkpoint", "", f"{source}" + (f", step {card.step}" if card.step is not None else ""), ""]
    lines += ["## Data", ""] + _table(card.data, "split")
    algorithm = dict(card.algorithm)
    if card.reward:
        algorithm["reward_fn"] = card.reward
    lines += ["## Algorithm", ""] + _table(algorithm, "setting")
    lines += ["## Evaluation metrics", ""] + _table({k: f"{v:.6g}" for k, v in card.metrics.items()}, "metric")
    return "\n".join(lines)


def _table(values: Mapping[str, Any], key_header: str) -> list[str]:
    if not values:
        return ["not recorded", ""]
    rows = [f"| {key_header} | value |", "| --- | --- |"]
    rows += [f"| {k} | `{v}` |" for k, v in values.items()]
    return [*rows, ""]


def write_model_card(export_dir: str | Path, card: ModelCard) -> Path:
    """Writes ``README.md`` into ``export_dir`` (replacing one there); returns its path."""
    path = Path(export_dir) / MODEL_CARD_FILE
    path.write_text(render_model_card(card) + "\n")
    return path
