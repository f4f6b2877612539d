"""``trainer.early_stop``: stop training at a validation metric threshold, after ``patience`` validations
without a new best (NeMo-RL's ``stop_at_validation_threshold``), or when the wall-clock budget ``max_time_s``
would be overrun by one more step, and record it as the run's outcome.

An early-stopped run is a success: the trainer checkpoints the stopping step, writes :data:`OUTCOME_FILE` into the
run folder (and the remote store), logs ``training/early_stopped`` (1) and tags the MLflow run
``rlhf.outcome=early_stopped``, and the entrypoint exits 0. The pipeline's evaluation sensors read the outcome file:
the first evaluation planned after the stopping step evaluates the stopping step's checkpoint, the later ones are
skipped, not failed, so evaluation and registration go on with the checkpoints there are, the last model included
(:func:`rlhf_ops.pipeline.checkpoints.awaited_checkpoint`). Torch-free (the Airflow side reads the outcome
through it).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
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

    def __init__(self, config: EarlyStopConfig, *, started: float | None = None) -> None:
        """``started``: when this attempt began (``time.time()`` scale); default, the driver process's start."""
        self.config = config
        self.best: float | None = None
        self.since_best = 0
        self.reason: str | None = None  # why the run stopped; None while it goes on
        self.started = _process_start() if started is None else started
        self.earlier_s = 0.0  # wall-clock of a resumed run's earlier attempts, up to their last checkpoint
        self.recent_steps: deque[float] = deque(maxlen=3)

    @property
    def enabled(self) -> bool:
        return self.config.metric is not None or self.config.max_time_s is not None

    def elapsed_s(self) -> float:
        """The run's wall-clock so far: this attempt since its start, plus the earlier attempts'."""
        return self.earlier_s + max(0.0, time.time() - self.started)

    def update(self, metrics: dict[str, float], step: int, *, step_s: float | None = None) -> bool:
        """Reads a step's ``metrics`` (and, for the time budget, the step's seconds ``step_s``); True (and
        ``training/early_stopped`` in ``metrics``) when the run must stop after ``step``.

        Raises:
            ConfigError: a validation did not log ``trainer.early_stop.metric``.
        """
        self._validation_rule(metrics, step)
        if step_s is not None:
            self.recent_steps.append(step_s)
        if self.config.max_time_s is not None and self.recent_steps:
            elapsed, budget, longest = self.elapsed_s(), self.config.max_time_s, max(self.recent_steps)
            metrics["training/wall_clock_s"] = elapsed
            if self.reason is None and elapsed + longest > budget:
                self.reason = (
                    f"wall-clock budget: {elapsed:.0f} s used of trainer.early_stop.max_time_s={budget:g} and a "
                    f"step takes up to {longest:.0f} s, at step {step}"
                )
        if self.reason is not None:
            metrics["training/early_stopped"] = 1.0
        return self.reason is not None

    def _validation_rule(self, metrics: dict[str, float], step: int) -> None:
        cfg = self.config
        if cfg.metric is None or not any(k.startswith("val/") for k in metrics):
            return  # off, or no validation at this step
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

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"best": self.best, "since_best": self.since_best}
        if self.config.max_time_s is not None:  # only a budgeted run keeps its clock (the rest stays seed-determined)
            state["elapsed_s"] = self.elapsed_s()
        return state

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.best, self.since_best = state.get("best"), int(state.get("since_best", 0))
            self.earlier_s = float(state.get("elapsed_s", 0.0))


def _process_start() -> float:
    """When this process started (``time.time()`` scale): the driver's start, Ray's start-up included."""
    import psutil

    return float(psutil.Process().create_time())


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
