"""Evaluation metrics from scored responses: reward, accuracy, pass@k, response lengths (pure Python).

Names are MLflow-safe and the same in ``eval.json`` and in MLflow (``eval/pass_at_4``, not ``pass@4``,
which MLflow would rename). Greedy responses give ``eval/reward/mean`` and ``eval/acc``; the ``n`` sampled
responses per prompt give ``eval/sample/reward/mean``, ``eval/mean_acc`` (average accuracy of a sample) and
the unbiased ``eval/pass_at_<k>`` of Chen et al. (2021) for each k in ``ks``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX = "eval"


@dataclass(frozen=True, kw_only=True)
class ScoredResponse:
    """One response and its score."""

    prompt_index: int
    data_source: str
    response: str
    length: int
    """Response tokens, EOS included."""
    score: float
    correct: float | None
    """1.0 / 0.0 when the row has a ground truth the reward function checks, else None."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` draws (without replacement) of ``n`` samples is correct.

    ``1 - C(n - c, k) / C(n, k)``, with ``c`` correct samples. Example: n=4, c=1, k=2 → 1 - C(3,2)/C(4,2)
    = 1 - 3/6 = 0.5.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def default_ks(n: int) -> list[int]:
    """``1, 2, 4, …`` up to ``n``, plus ``n`` itself; empty for ``n == 0``."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if n and ks[-1] != n:
        ks.append(n)
    return ks


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else float("nan")


def greedy_metrics(rows: Sequence[ScoredResponse]) -> dict[str, float]:
    """Reward, accuracy and lengths of one greedy response per prompt, overall and per data source."""
    metrics = {
        f"{PREFIX}/reward/mean": _mean(r.score for r in rows),
        f"{PREFIX}/response_length/mean": _mean(r.length for r in rows),
        f"{PREFIX}/response_length/max": float(max((r.length for r in rows), default=0)),
        f"{PREFIX}/response_length/min": float(min((r.length for r in rows), default=0)),
        f"{PREFIX}/num_prompts": float(len(rows)),
    }
    checked = [r.correct for r in rows if r.correct is not None]
    if checked:
        metrics[f"{PREFIX}/acc"] = _mean(checked)
    by_source: dict[str, list[ScoredResponse]] = defaultdict(list)
    for row in rows:
        by_source[row.data_source].append(row)
    if len(by_source) > 1 or any(source for source in by_source):
        for source, group in sorted(by_source.items()):
            metrics[f"{PREFIX}/{source}/reward/mean"] = _mean(r.score for r in group)
            source_checked = [r.correct for r in group if r.correct is not None]
            if source_checked:
                metrics[f"{PREFIX}/{source}/acc"] = _mean(source_checked)
    return metrics


def sample_metrics(rows: Sequence[ScoredResponse], *, n: int, ks: Sequence[int]) -> dict[str, float]:
    """Metrics of ``n`` sampled responses per prompt: mean reward, mean accuracy, pass@k.

    Raises:
        ValueError: a prompt does not have exactly ``n`` samples, or a k is outside ``1..n``.
    """
    if not rows:
        return {}
    per_prompt: dict[int, list[ScoredResponse]] = defaultdict(list)
    for row in rows:
        per_prompt[row.prompt_index].append(row)
    if any(len(group) != n for group in per_prompt.values()):
        raise ValueError(f"sample_metrics: every prompt needs n={n} samples")
    metrics = {
        f"{PREFIX}/sample/reward/mean": _mean(r.score for r in rows),
        f"{PREFIX}/sample/response_length/mean": _mean(r.length for r in rows),
    }
    checked = {i: [r.correct for r in g if r.correct is not None] for i, g in per_prompt.items()}
    checked = {i: c for i, c in checked.items() if len(c) == n}
    if checked:
        metrics[f"{PREFIX}/mean_acc"] = _mean(v for c in checked.values() for v in c)
        for k in ks:
            correct_counts = [int(sum(1 for v in c if v >= 1.0)) for c in checked.values()]
            metrics[f"{PREFIX}/pass_at_{k}"] = _mean(pass_at_k(n, c, k) for c in correct_counts)
    return metrics
