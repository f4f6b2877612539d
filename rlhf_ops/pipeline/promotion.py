"""Promotion a team can trust: a checkpoint replaces another only on a win that holds on the eval set.

Two checkpoints (or a checkpoint and the registered champion) evaluated on the same prompts are compared
prompt by prompt (:mod:`rlhf_ops.evaluation.paired`): the interval of the mean per-prompt gain at
``confidence`` decides, with the margin ``min_gain`` set in the spec (``params.promotion``)::

    win   the whole interval lies above min_gain      the candidate replaces the incumbent
    loss  the whole interval lies below 0             the incumbent stays
    tie   anything else                               the incumbent stays (the earlier checkpoint, the champion)

Choosing the run's best checkpoint walks the evaluated checkpoints in step order: the first is the incumbent,
each later one challenges it and takes its place only on a win. So equal scores keep the earlier checkpoint,
and noise alone (two checkpoints at ``eval/reward/mean=0.500``) never moves anything.

Per-prompt scores come from the eval reports' ``per_prompt`` rows; each aggregate metric maps to one column
(:data:`PER_PROMPT_COLUMNS`). Two reports are comparable only when they were made on the same eval set (the
``eval_set.sha256`` of the prompts and answers): otherwise the pairing would be meaningless.

Standard library only: the Airflow side can import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlhf_ops.evaluation.paired import PairedGain, paired_bootstrap, paired_proportion_interval

Outcome = Literal["win", "tie", "loss", "no_incumbent"]

# aggregate metric of eval.json -> the per-prompt column that averages to it
PER_PROMPT_COLUMNS: dict[str, str] = {
    "eval/reward/mean": "score",
    "eval/acc": "correct",
    "eval/sample/reward/mean": "sample_score",
    "eval/mean_acc": "sample_acc",
}


# The metrics a test can run on (the keys of PER_PROMPT_COLUMNS; a test keeps the two equal).
PromotionMetric = Literal["eval/acc", "eval/mean_acc", "eval/reward/mean", "eval/sample/reward/mean"]


class PromotionSpec(BaseModel):
    """``params.promotion``: how a checkpoint wins (against an earlier one, and against the champion)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: PromotionMetric | None = Field(
        None, description=f"Per-prompt metric of the test, one of {sorted(PER_PROMPT_COLUMNS)}; empty: eval_metric."
    )
    min_gain: float = Field(0.0, ge=0.0, le=1.0, description="Margin: the interval's low end must exceed it.")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Two-sided coverage of the interval.")
    method: Literal["bootstrap", "wald"] = Field(
        "bootstrap", description="Paired bootstrap over prompts, or the paired-proportion Wald interval (0/1 only)."
    )
    resamples: int = Field(10_000, ge=1000, le=100_000, description="Bootstrap resamples.")
    seed: int = Field(0, description="Seed of the bootstrap (the decision is deterministic).")

    def metric_name(self, eval_metric: str) -> str:
        """The metric the test uses; ``ValueError`` naming the field when it has no per-prompt column."""
        name = self.metric or eval_metric
        if name not in PER_PROMPT_COLUMNS:
            field = "promotion.metric" if self.metric else "eval_metric"
            raise ValueError(
                f"{field}={name!r} has no per-prompt scores to test a win on. "
                f"Fix: set promotion.metric to one of {sorted(PER_PROMPT_COLUMNS)}"
            )
        return name


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One comparison: ``candidate`` against ``incumbent`` on ``metric``, and what it decided."""

    outcome: Outcome
    candidate: str
    incumbent: str | None
    metric: str
    min_gain: float
    gain: PairedGain | None = None

    @property
    def replaces(self) -> bool:
        """Whether the candidate takes the incumbent's place."""
        return self.outcome in ("win", "no_incumbent")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gain"] = None if self.gain is None else self.gain.to_dict()
        out["replaces"] = self.replaces
        return out

    def summary(self) -> str:
        """One line: ``global_step_4 vs global_step_2 on eval/acc: tie (gain +1.6 pts, 95% CI [-3.1, +6.3] ...)``."""
        if self.gain is None:
            return f"{self.candidate}: {self.outcome} (nothing to compare with on {self.metric})"
        g = self.gain
        pct = round(g.confidence * 100)
        return (
            f"{self.candidate} vs {self.incumbent} on {self.metric}: {self.outcome} "
            f"({g.before:.3f} -> {g.after:.3f}, gain {g.gain:+.3f}, {pct}% CI [{g.low:+.3f}, {g.high:+.3f}], "
            f"n={g.n}, margin {self.min_gain:g})"
        )

    def metrics(self, prefix: str) -> dict[str, float]:
        """MLflow metrics of the interval (``<prefix>/gain``, ``/low``, ``/high``, ``/n``); empty without one."""
        if self.gain is None:
            return {}
        g = self.gain
        return {f"{prefix}/gain": g.gain, f"{prefix}/low": g.low, f"{prefix}/high": g.high, f"{prefix}/n": float(g.n)}


def eval_set_id(report: Mapping[str, Any]) -> str | None:
    """The fingerprint of the prompts a report was made on (None for reports made before it existed)."""
    eval_set = report.get("eval_set") or {}
    value = eval_set.get("sha256")
    return str(value) if value else None


def per_prompt_scores(report: Mapping[str, Any], metric: str) -> dict[int, float]:
    """``{prompt index: score}`` of ``metric``'s per-prompt column in an eval report.

    Raises:
        ValueError: the report has no per-prompt rows, or none carries the column.
    """
    column = PER_PROMPT_COLUMNS[metric]
    rows = report.get("per_prompt") or []
    scores = {int(r["index"]): float(r[column]) for r in rows if isinstance(r.get(column), int | float)}
    if not scores:
        where = report.get("checkpoint") or report.get("model_dir") or "an eval report"
        raise ValueError(
            f"{where} has no per-prompt {column!r} scores for {metric}; re-evaluate it with this version "
            "(eval.json per_prompt rows), or set promotion.metric to a metric it has"
        )
    return scores


def compare(
    incumbent: Mapping[str, Any] | None,
    candidate: Mapping[str, Any],
    spec: PromotionSpec,
    *,
    metric: str,
    names: tuple[str | None, str],
) -> Decision:
    """Test ``candidate`` (an eval report) against ``incumbent`` on their shared prompts.

    Args:
        incumbent: The report of the checkpoint / champion in place (None: nothing in place, the candidate wins).
        candidate: The challenger's report.
        spec: Margin, confidence and interval method.
        metric: The aggregate metric whose per-prompt column is compared (:data:`PER_PROMPT_COLUMNS`).
        names: ``(incumbent label, candidate label)`` for the decision's text.

    Raises:
        ValueError: the reports were made on different eval sets, or share no prompt.
    """
    if incumbent is None:
        return Decision(
            outcome="no_incumbent", candidate=names[1], incumbent=None, metric=metric, min_gain=spec.min_gain
        )
    a, b = eval_set_id(incumbent), eval_set_id(candidate)
    if a and b and a != b:
        raise ValueError(
            f"{names[1]} and {names[0]} were evaluated on different eval sets ({b[:12]} vs {a[:12]}); "
            "a paired test needs the same prompts: evaluate both on one set"
        )
    before, after = per_prompt_scores(incumbent, metric), per_prompt_scores(candidate, metric)
    shared = sorted(set(before) & set(after))
    if not shared:
        raise ValueError(f"{names[1]} and {names[0]} share no evaluated prompt; evaluate both on the same prompts")
    xs, ys = [before[i] for i in shared], [after[i] for i in shared]
    gain = _interval(xs, ys, spec)
    outcome: Outcome = "win" if gain.low > spec.min_gain else "loss" if gain.high < 0.0 else "tie"
    return Decision(
        outcome=outcome, candidate=names[1], incumbent=names[0], metric=metric, min_gain=spec.min_gain, gain=gain
    )


def _interval(before: Sequence[float], after: Sequence[float], spec: PromotionSpec) -> PairedGain:
    if spec.method == "wald":
        return paired_proportion_interval(before, after, confidence=spec.confidence)
    return paired_bootstrap(before, after, confidence=spec.confidence, resamples=spec.resamples, seed=spec.seed)


def choose_checkpoint(
    reports: Mapping[int, Mapping[str, Any]], spec: PromotionSpec, *, metric: str
) -> tuple[int | None, list[Decision]]:
    """The run's best checkpoint: walk the steps in order, a later one replaces the best only on a win.

    Returns:
        ``(best step or None without reports, the decisions made on the way)``.
    """
    steps = sorted(reports)
    if not steps:
        return None, []
    best, decisions = steps[0], []
    for step in steps[1:]:
        decision = compare(reports[best], reports[step], spec, metric=metric, names=(_label(best), _label(step)))
        decisions.append(decision)
        if decision.replaces:
            best = step
    return best, decisions


def _label(step: int) -> str:
    return f"global_step_{step}"
