"""The end of a pipeline run as a person reads it: a small table by checkpoint step and a learning curve.

``run_summary`` gathers what the run left behind (the trainer's ``metrics.jsonl``, each checkpoint's
``eval.json``, the register task's decision) into :class:`RunSummary`; ``summary_lines`` renders it in a few
lines; ``plot_learning_curve`` draws training reward and each evaluation by step into a PNG (matplotlib,
Agg backend) that the demo writes to the run folder and logs to the MLflow run (``plots/``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.console import REWARD_KEY, read_metrics

log = logging.getLogger(__name__)

EVAL_COLUMNS = (("eval/acc", "acc"), ("eval/reward/mean", "reward"), ("eval/pass_at_4", "pass@4"))
CURVE_FILE = "learning_curve.png"
CURVE_ARTIFACT = "plots"


@dataclass(kw_only=True)
class RunSummary:
    """Numbers of one run: training reward by step, eval metrics by checkpoint step, the registry decision."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    evals: dict[int, dict[str, float]] = field(default_factory=dict)
    registered: Mapping[str, Any] = field(default_factory=dict)

    def train_at(self, step: int) -> float | None:
        """Mean training reward over the (up to) 5 steps ending at ``step`` (one step is noisy)."""
        window = [r for s, r in self.train if step - 5 < s <= step]
        return sum(window) / len(window) if window else None


def run_summary(
    run_dir: Path, reports: Mapping[int, Mapping[str, Any]], registered: Mapping[str, Any] | None
) -> RunSummary:
    """Collect the summary of the run in ``run_dir`` (``metrics.jsonl``) with its eval reports."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [(int(r["step"]), float(r[REWARD_KEY])) for r in rows if isinstance(r.get(REWARD_KEY), int | float)]
    val_keys = [k for r in rows for k in r if k.startswith("val/") and k.endswith("/reward/mean")]
    val = []
    if val_keys:
        key = val_keys[0]
        val = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
    evals = {
        int(step): {k: float(v) for k, v in (rep.get("metrics") or {}).items() if isinstance(v, int | float)}
        for step, rep in reports.items()
    }
    return RunSummary(train=train, val=val, evals=evals, registered=dict(registered or {}))


def _fmt(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def summary_lines(summary: RunSummary) -> list[str]:
    """The table (one row per evaluated checkpoint) and the training reward first/last, as lines."""
    lines = []
    if summary.train:
        (s0, r0), (s1, r1) = summary.train[0], summary.train[-1]
        first, last = summary.train_at(s0 + 4) or r0, summary.train_at(s1) or r1
        lines.append(f"  train reward (mean of 5 steps): {first:.3f} at step {s0} -> {last:.3f} at step {s1}")
    chosen = summary.registered.get("best_step")
    walk = {
        int(str(d.get("candidate", "")).removeprefix("global_step_") or -1): d.get("outcome")
        for d in summary.registered.get("checkpoint_decisions") or []
    }
    header = "  step  train reward  " + "  ".join(f"{label:>7}" for _, label in EVAL_COLUMNS) + "  checkpoint"
    lines.append(header)
    for step in sorted(summary.evals):
        metrics = summary.evals[step]
        cells = "  ".join(f"{_fmt(metrics.get(key)):>7}" for key, _ in EVAL_COLUMNS)
        note = "chosen" if step == chosen else str(walk.get(step) or "")
        if step == chosen and step in walk:
            note = f"chosen ({walk[step]})"
        elif step != chosen and step in walk:
            note = f"not chosen ({walk[step]})"
        lines.append(f"  {step:>4}  {_fmt(summary.train_at(step)):>12}  {cells}  {note}")
    return lines


def plot_learning_curve(summary: RunSummary, out: Path, *, title: str) -> Path | None:
    """Training reward (and validation reward) by step, each checkpoint's eval metrics as markers; None w/o data."""
    if not summary.train and not summary.evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2), dpi=110)
    try:
        if summary.train:
            steps, rewards = zip(*summary.train, strict=True)
            ax.plot(steps, rewards, color="#9ecae1", lw=1, label="train reward (per step)")
            smooth = [summary.train_at(s) or 0.0 for s in steps]
            ax.plot(steps, smooth, color="#2171b5", lw=2, label="train reward (mean of 5)")
        if summary.val:
            vs, vr = zip(*summary.val, strict=True)
            ax.plot(vs, vr, "s--", color="#6a51a3", ms=4, label="validation reward")
        markers = {
            "eval/acc": ("o", "#238b45"),
            "eval/reward/mean": ("^", "#d94801"),
            "eval/pass_at_4": ("D", "#737373"),
        }
        for key, label in EVAL_COLUMNS:
            points = sorted((s, m[key]) for s, m in summary.evals.items() if key in m)
            if points:
                xs, ys = zip(*points, strict=True)
                marker, color = markers[key]
                ax.plot(xs, ys, marker=marker, ls=":", color=color, ms=7, label=f"eval {label} (checkpoint)")
        ax.set_xlabel("global step")
        ax.set_ylabel("score")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over the curves
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out


def log_curve_to_mlflow(png: Path, *, run_id: str, tracking_uri: str | None = None) -> str:
    """Log the PNG under ``plots/`` of the run; returns its artifact path."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=tracking_uri).log_artifact(run_id, str(png), CURVE_ARTIFACT)
    return f"{CURVE_ARTIFACT}/{png.name}"
