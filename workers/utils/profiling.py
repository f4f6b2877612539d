"""Per-stage peak memory and torch profiler traces inside a worker (one :class:`StageMonitor` per rank).

Each monitored worker method is one *stage* of the controller's step (``generate``, ``ref``, ``update_actor``,
``values``, ``update_critic``). For every call the monitor records the stage's peak memory, with the window
reset at the stage's start:

- CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after ``reset_peak_memory_stats``.
- CPU: torch keeps no host-allocator statistics, so a daemon thread samples the process's resident set size
  (``psutil``, every 5 ms) during the stage; the peak is the largest sample (or the RSS at the start / end).
  Allocations that live for less than 5 ms can be missed. Also the stage's minor page faults (``ru_minflt``):
  memory the stage touched for the first time since the allocator got it from the OS.

In a step listed in ``profile_steps`` (the call's ``step`` argument), the call also runs
under ``torch.profiler`` (CPU and, on GPU, CUDA activities, with shapes and memory) and writes a Chrome trace to
``<profile_dir>/step_<N>/<role>_<stage>_rank<R>.json``; the driver logs those files as MLflow artifacts.
"""

from __future__ import annotations

import functools
import resource
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlhf_ops.protocol import DataProto

__all__ = ["StageMonitor", "monitored", "trace_path"]

F = TypeVar("F", bound=Callable[..., Any])
_SAMPLE_S = 0.005


def trace_path(profile_dir: str | Path, *, step: int, role: str, stage: str, rank: int) -> Path:
    """Where a worker writes the trace of one stage of one step."""
    return Path(profile_dir) / f"step_{step}" / f"{role}_{stage}_rank{rank}.json"


class _RSSPeak:
    """Samples the RSS in a thread between ``start`` and ``stop``; ``peak`` is the largest value in bytes."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak


class StageMonitor:
    """Stage peak memory (every call) and profiler traces (chosen steps) of one rank of one role.

    Args:
        role: ``actor`` or ``critic`` (metric and file names).
        rank: This worker's rank.
        device: The compute device (CUDA: allocator statistics; CPU: sampled RSS).
        profile_steps: Global steps to trace.
        profile_dir: Absolute folder for traces (shared by the driver: a local run or a shared FS).
    """

    def __init__(
        self, *, role: str, rank: int, device: torch.device, profile_steps: tuple[int, ...] = (), profile_dir: str = ""
    ) -> None:
        self.role, self.rank, self.device = role, rank, device
        self.profile_steps, self.profile_dir = frozenset(profile_steps), profile_dir
        self._metrics: dict[str, float] = {}
        self.traces: list[Path] = []

    @contextmanager
    def stage(self, name: str, *, step: int | None) -> Iterator[None]:
        """Measures the peak memory of the enclosed stage; traces it when ``step`` is a profiled step."""
        prefix = f"memory/{self.role}/{name}"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            sampler = None
        else:
            sampler = _RSSPeak()
            sampler.start()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            if step is not None and step in self.profile_steps:
                with self._profile(name, step):
                    yield
            else:
                yield
        finally:
            if sampler is not None:
                self._metrics[f"{prefix}/peak_rss_gb"] = sampler.stop() / 2**30
                # Pages first touched in the stage: each costs a kernel entry (~5 us measured on a VM), so a
                # stage that keeps re-faulting freed memory shows here (workers/entrypoints/train.py: malloc).
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                self._metrics[f"{prefix}/minor_faults"] = float(faults)
            else:
                torch.cuda.synchronize(self.device)
                self._metrics[f"{prefix}/peak_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                self._metrics[f"{prefix}/peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30

    @contextmanager
    def _profile(self, name: str, step: int) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        path = trace_path(self.profile_dir, step=step, role=self.role, stage=name, rank=self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
            yield
        prof.export_chrome_trace(str(path))
        self.traces.append(path)

    def pop_metrics(self) -> dict[str, float]:
        """The stage peaks recorded since the last call (every stage's latest call), then forgets them."""
        out, self._metrics = self._metrics, {}
        return out


def _step_of(kwargs: dict[str, Any]) -> int | None:
    """The call's ``step`` argument (the controller passes it by keyword)."""
    step = kwargs.get("step")
    return int(step) if step is not None else None


def monitored(stage: str, *, report: bool = False) -> Callable[[F], F]:
    """Runs a worker method under ``self.monitor.stage(stage, step=...)`` (a no-op before ``self.monitor`` exists).

    Place it under ``@register`` (closest to the ``def``); the step is the call's ``step`` keyword argument.
    With ``report``, the method's last stage of the step for its role, the peaks of every stage since the last
    report (this one included) are added to the returned ``DataProto``'s ``meta_info["metrics"]``.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            monitor: StageMonitor | None = getattr(self, "monitor", None)
            if monitor is None:
                return fn(self, *args, **kwargs)
            with monitor.stage(stage, step=_step_of(kwargs)):
                out = fn(self, *args, **kwargs)
            if report and isinstance(out, DataProto):
                out.meta_info["metrics"] = {**(out.meta_info.get("metrics") or {}), **monitor.pop_metrics()}
            return out

        return wrapper  # type: ignore[return-value]

    return decorate
