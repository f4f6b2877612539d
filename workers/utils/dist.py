"""Small collectives over the data-parallel group: sizes, global counts, metric reduction.

All functions degrade to local values when ``torch.distributed`` is not initialised (single process).
Collectives run on tensors of the caller's ``device`` (CPU for gloo, CUDA for nccl).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["MetricAccumulator", "all_reduce", "dp_world_size", "global_counts"]


def dp_world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group`` (default: the default group); 1 without ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce(tensor: Tensor, *, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    """In-place all-reduce over ``group`` (a no-op for a single rank); returns ``tensor``."""
    if dp_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def global_counts(response_mask: Tensor, *, group: dist.ProcessGroup | None) -> tuple[float, float]:
    """Valid tokens and non-empty sequences of a mini-batch summed over every rank of ``group``.

    Args:
        response_mask: (b, R) this rank's part of the mini-batch.

    Returns:
        ``(num_tokens, num_seqs)``, each at least 1 (an all-masked mini-batch then gives a zero loss).
    """
    mask = response_mask.to(torch.float64)
    local = torch.stack([mask.sum(), (mask.sum(dim=-1) > 0).to(torch.float64).sum()])  # (2,)
    total = all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    return max(float(total[0]), 1.0), max(float(total[1]), 1.0)


class MetricAccumulator:
    """Collects metrics over micro-batches and optimizer steps, reduced over ranks in one collective.

    Three kinds: ``add_mean(name, value, weight)`` (weighted mean, e.g. token-weighted clip fractions, so
    the result does not depend on the micro-batch split), ``add_sum(name, value)`` (summed over
    micro-batches and ranks, then divided by the number of optimizer steps: a loss contribution summed
    over a mini-batch is the mini-batch loss), ``add_step(name, value)`` (already global per step, e.g.
    the grad norm: averaged over steps; names ending in ``/lr`` keep the last value). Values stay tensors
    on ``device`` until :meth:`reduce`, so accumulating never forces a device sync.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mean: dict[str, tuple[Tensor, Tensor]] = {}
        self._sum: dict[str, Tensor] = {}
        self._step: dict[str, list[float]] = defaultdict(list)
        self.num_steps = 0

    def _t(self, value: Tensor | float) -> Tensor:
        return torch.as_tensor(value, device=self.device).detach().to(torch.float64)

    def add_mean(self, name: str, value: Tensor | float, weight: Tensor | float) -> None:
        total, norm = self._mean.get(name, (self._t(0.0), self._t(0.0)))
        self._mean[name] = (total + self._t(value) * self._t(weight), norm + self._t(weight))

    def add_sum(self, name: str, value: Tensor | float) -> None:
        self._sum[name] = self._sum.get(name, self._t(0.0)) + self._t(value)

    def add_step(self, name: str, value: float) -> None:
        self._step[name].append(value)

    def reduce(self, *, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Global metrics (identical on every rank). A collective: every rank must call it, same names."""
        mean_names, sum_names = sorted(self._mean), sorted(self._sum)
        flat = [t for n in mean_names for t in self._mean[n]] + [self._sum[n] for n in sum_names]
        values: list[float] = []
        if flat:
            values = all_reduce(torch.stack(flat), op=dist.ReduceOp.SUM, group=group).tolist()
        out: dict[str, float] = {}
        for i, name in enumerate(mean_names):
            total, weight = values[2 * i], values[2 * i + 1]
            out[name] = total / weight if weight > 0 else 0.0
        offset = 2 * len(mean_names)
        for i, name in enumerate(sum_names):
            out[name] = values[offset + i] / max(self.num_steps, 1)
        for name, seq in self._step.items():
            out[name] = seq[-1] if name.endswith("/lr") else sum(seq) / len(seq)
        return out
