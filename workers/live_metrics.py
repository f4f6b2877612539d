"""Live metrics through Ray's metrics: Prometheus text on each node's metrics export port while a run runs.

``trainer.logger`` with ``prometheus`` adds :class:`RayMetricsLogger` to the driver's loggers: every step metric
becomes a Ray ``Gauge`` (``actor/pg_loss`` -> ``rlhf_actor_pg_loss``; Ray's exporter prefixes ``ray_``, so
Prometheus sees ``ray_rlhf_actor_pg_loss``), tagged with the experiment and run, plus ``rlhf_trainer_step``. The
rollout workers publish their engine's own measurements per rank (:class:`RolloutMetrics`): generation time and
tokens, weight sync time and bytes. Ray's metrics agent on each node serves them at
``http://<node>:<metrics-export-port>/metrics`` (``ray start --metrics-export-port=N``, or
``ray.init(_metrics_export_port=N)`` for a local cluster); Ray's Prometheus service discovery file
(``/tmp/ray/prom_metrics_service_discovery.json``) lists every node's endpoint. Values reach the endpoint at
Ray's report interval (``RAY_metrics_report_interval_ms``, 10 s by default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_ops.tracking.logger import to_float_metrics

__all__ = ["RayMetricsLogger", "RolloutMetrics", "prometheus_name"]

PREFIX = "rlhf_"
_INVALID = re.compile(r"[^a-zA-Z0-9_]+")


def prometheus_name(key: str, *, prefix: str = PREFIX) -> str:
    """A metric key as a Prometheus name: ``timing_s/update_actor`` -> ``rlhf_timing_s_update_actor``."""
    return prefix + _INVALID.sub("_", key).strip("_")


class _Gauges:
    """Ray gauges by name, created on first use (a Gauge registers itself with the node's metrics agent)."""

    def __init__(self, tag_keys: Sequence[str]) -> None:
        self.tag_keys = tuple(tag_keys)
        self._gauges: dict[str, Any] = {}

    def set(self, name: str, value: float, tags: Mapping[str, str], description: str = "") -> None:
        from ray.util.metrics import Gauge

        gauge = self._gauges.get(name)
        if gauge is None:
            gauge = Gauge(name, description=description or name, tag_keys=self.tag_keys)
            self._gauges[name] = gauge
        gauge.set(value, tags=dict(tags))


class RayMetricsLogger:
    """A ``MetricLogger`` that sets one Ray gauge per step metric (driver side, a Ray worker or driver process).

    Args:
        experiment: ``trainer.experiment_name`` (tag ``experiment``).
        run: ``trainer.run_name`` (tag ``run``), so several runs on one cluster stay apart in Grafana.
    """

    def __init__(self, *, experiment: str, run: str) -> None:
        self.tags = {"experiment": experiment, "run": run}
        self._gauges = _Gauges(tuple(self.tags))
        self.names: dict[str, str] = {}
        """``{metric key: Prometheus name (without Ray's ray_ prefix)}`` of every metric set so far."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in to_float_metrics(metrics, step).items():
            name = self.names.setdefault(key, prometheus_name(key))
            self._gauges.set(name, value, self.tags, description=f"rlhf-ops step metric {key}")
        self._gauges.set(prometheus_name("trainer/step"), float(step), self.tags, "last logged training step")

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Parameters are not time series: nothing to export."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Artifacts are not time series: nothing to export."""

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Artifacts are not time series: nothing to export."""

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
        """Artifacts are not time series: nothing to export."""

    def close(self) -> None:
        """Ray keeps the last values until the process ends; nothing to release."""


class RolloutMetrics:
    """The rollout engine's own measurements on one rank, as Ray gauges and counters (worker side).

    Exported (tags ``engine``, ``rank``): ``rlhf_rollout_generate_seconds`` (last call),
    ``rlhf_rollout_response_tokens_per_second`` (last call), ``rlhf_rollout_response_tokens_total`` and
    ``rlhf_rollout_sequences_total`` (counters), ``rlhf_rollout_weight_sync_seconds`` and
    ``rlhf_rollout_weight_sync_bytes`` (last sync).
    """

    def __init__(self, *, engine: str, rank: int) -> None:
        from ray.util.metrics import Counter

        self.tags = {"engine": engine, "rank": str(rank)}
        self._gauges = _Gauges(tuple(self.tags))
        keys = tuple(self.tags)
        self._tokens = Counter(f"{PREFIX}rollout_response_tokens_total", "response tokens generated", tag_keys=keys)
        self._sequences = Counter(f"{PREFIX}rollout_sequences_total", "sequences generated", tag_keys=keys)

    def publish(self, *, generate_s: float, response_tokens: int, sequences: int, sync: Mapping[str, float]) -> None:
        """One rollout call: its generation time and output, and the weight sync before it (``sync`` holds the
        sharding manager's ``last_metrics``; empty without one)."""
        self._gauges.set(f"{PREFIX}rollout_generate_seconds", generate_s, self.tags, "seconds of the last rollout")
        rate = response_tokens / generate_s if generate_s > 0 else 0.0
        self._gauges.set(f"{PREFIX}rollout_response_tokens_per_second", rate, self.tags, "last rollout's tokens/s")
        if response_tokens:
            self._tokens.inc(float(response_tokens), tags=self.tags)
        if sequences:
            self._sequences.inc(float(sequences), tags=self.tags)
        if sync:
            seconds = float(sync.get("timing_s/update_weights", 0.0))
            self._gauges.set(f"{PREFIX}rollout_weight_sync_seconds", seconds, self.tags, "seconds of the last sync")
            sent = float(sync.get("weight_sync/bytes", 0.0))
            self._gauges.set(f"{PREFIX}rollout_weight_sync_bytes", sent, self.tags, "bytes of the last sync")
