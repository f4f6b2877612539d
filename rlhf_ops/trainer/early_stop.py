"""``trainer.early_stop``: stop training at a validation metric threshold or after ``patience`` validations
without a new best (NeMo-RL's ``stop_at_validation_threshold``), and record it as the run's outcome.

An early-stopped run is a success: the trainer checkpoints the stopping step, writes :data:`OUTCOME_FILE` into the
run folder (and the remote store), logs ``training/early_stopped`` (1) and tags the MLflow run
``rlhf.outcome=early_stopped``, and the entrypoint exits 0. The pipeline's evaluation sensors read the outcome file:
a checkpoint planned after the stopping step is skipped, not failed, so evaluation and registration go on with
the checkpoints there are (:func:`rlhf_ops.pipeline.checkpoints.checkpoint_ready`). Torch-free (the Airflow side
reads the outcome through it).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_ops.config.errors import ConfigError, ConfigProblem
from rlhf_ops.config.reproducibility import EarlyStopConfig

log = logging.getLogger(__name__)

OUTCOME_FILE = "outcome.json"
EARLY_STOPPED = "early_stopped"
OUTCOME_TAG = "rlhf.outcome"


class EarlyStop:
    """The early-stop rule's state across validations (saved with the trainer's state: a resume keeps it)."""

    def __init__(self, config: EarlyStopConfig) -> None:
        self.config = config
        self.best: float | None = None
        self.since_best = 0
        self.reason: str | None = None  # why the run stopped; None while it goes on

    @property
    def enabled(self) -> bool:
        return self.config.metric is not None

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Reads a validation's ``metrics``; True (and ``training/early_stopped`` in ``metrics``) when the run must
        stop after ``step``.

        Raises:
            ConfigError: the validation did not log ``trainer.early_stop.metric``.
        """
        cfg = self.config
        if cfg.metric is None or not any(k.startswith("val/") for k in metrics):
            return False  # off, or no validation at this step
        if cfg.metric not in metrics:
            logged = sorted(k for k in metrics if k.startswith("val/"))
            raise ConfigError(
                [
                    ConfigProblem(
                        "trainer.early_stop.metric",
                        f"{cfg.metric} is not among the validation's metrics ({', '.join(logged)})",
                        "set one of these",
                    )
                ]
            )
        value = float(metrics[cfg.metric])
        sign = 1.0 if cfg.mode == "max" else -1.0
        if math.isfinite(value) and (self.best is None or sign * (value - self.best) > cfg.min_delta):
            self.best, self.since_best = value, 0
        else:
            self.since_best += 1
        word = ">=" if cfg.mode == "max" else "<="
        if cfg.threshold is not None and math.isfinite(value) and sign * (value - cfg.threshold) >= 0:
            self.reason = f"{cfg.metric}={value:.6g} {word} threshold {cfg.threshold:g} at step {step}"
        elif cfg.patience is not None and self.since_best >= cfg.patience:
            self.reason = (
                f"{cfg.metric} has not improved on its best {self.best:.6g} for {self.since_best} validations "
                f"(patience {cfg.patience}) at step {step}"
            )
        if self.reason is not None:
            metrics["training/early_stopped"] = 1.0
        return self.reason is not None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "since_best": self.since_best}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.best, self.since_best = state.get("best"), int(state.get("since_best", 0))


def record_outcome(
    stop: EarlyStop, *, step: int, total_steps: int, run_dir: Path, remote_run_url: str | None, logger: Any
) -> dict[str, Any]:
    """Writes the early stop as the run's outcome (outcome file, MLflow tag); returns the outcome."""
    outcome = {"outcome": EARLY_STOPPED, "step": step, "total_steps": total_steps, "reason": stop.reason}
    if stop.best is not None:
        outcome["best"] = stop.best
    text = json.dumps(outcome, indent=2, sort_keys=True) + "\n"
    (run_dir / OUTCOME_FILE).write_text(text)
    if remote_run_url:
        from rlhf_ops.storage import open_store

        fs, root = open_store(remote_run_url)
        fs.pipe_file(f"{root}/{OUTCOME_FILE}", text.encode())
    for each in getattr(logger, "loggers", [logger]):
        if hasattr(each, "set_tags"):
            each.set_tags({OUTCOME_TAG: EARLY_STOPPED, "rlhf.stopped_at_step": step})
    log.info("early stop: %s", stop.reason)
    return outcome


def read_outcome(fs: Any, run_root: str) -> dict[str, Any] | None:
    """The run's outcome file (``fs``, the run folder as ``fs`` names it), or None when it has none."""
    try:
        with fs.open(f"{run_root}/{OUTCOME_FILE}", "rb") as f:
            data = json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
