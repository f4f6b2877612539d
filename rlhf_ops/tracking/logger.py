"""The ``MetricLogger`` protocol and its local implementations (console, JSONL, fan-out).

The trainer talks to one ``MetricLogger``; ``MultiLogger`` fans out to several (console + JSONL +
``rlhf_ops.tracking.mlflow_tracking.MlflowLogger``). Metric values may be Python numbers, numpy
scalars or one-element torch tensors: ``to_float`` turns them into ``float`` without importing torch.
Non-finite values are kept: MLflow stores NaN as NaN and ±inf as ±1.797e308 (SQL stores), and
``JsonlLogger`` writes them as ``null`` so that every line stays strict JSON.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from rlhf_ops.tracking.params import flatten_config

# Shown first by ConsoleLogger, in this order, when present (verl-compatible names).
KEY_METRICS: tuple[str, ...] = (
    "critic/score/mean",
    "critic/rewards/mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "response_length/mean",
    "timing_s/step",
    "perf/throughput",
)


@runtime_checkable
class MetricLogger(Protocol):
    """Where the trainer sends metrics, params and small artifacts. Implementations must be cheap no-ops
    when they have nothing to do, and ``close`` must be idempotent."""

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log scalar metrics for one global step (values: numbers, numpy scalars, 1-element tensors)."""
        ...

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log a (nested) config as flat params."""
        ...

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as an artifact at the relative path ``artifact_file``."""
        ...

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Store ``d`` as JSON (``.json``) or YAML (``.yaml``/``.yml``) at ``artifact_file``."""
        ...

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
        """Store rows as a table (``{"columns": [...], "data": [[...]]}`` JSON); appends if the table exists."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


def to_float(value: Any, *, key: str) -> float:
    """Convert a metric value to ``float``; raises ``ValueError`` naming ``key`` if it is not a scalar."""
    if hasattr(value, "item"):  # torch.Tensor, numpy scalar or array
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"metric {key!r}: expected a scalar, got shape {shape}; reduce it first") from exc
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise ValueError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


def to_float_metrics(metrics: Mapping[str, Any], step: int) -> dict[str, float]:
    """Validate ``step`` and convert every metric value with ``to_float``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"log_metrics: step must be a non-negative int (the global step), got {step!r}")
    return {str(k): to_float(v, key=str(k)) for k, v in metrics.items()}


def order_metrics(metrics: Mapping[str, float], *, first: Sequence[str] = KEY_METRICS) -> list[tuple[str, float]]:
    """Metrics in display order: the ``first`` names that are present, then the rest sorted by name."""
    head = [(k, metrics[k]) for k in first if k in metrics]
    chosen = {k for k, _ in head}
    return head + sorted((k, v) for k, v in metrics.items() if k not in chosen)


def table_payload(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Rows as MLflow's table JSON layout (pandas ``orient="split"`` without index): columns in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns.extend(str(c) for c in row if str(c) not in columns)
    return {"columns": columns, "data": [[row.get(c) for c in columns] for row in rows]}


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class ConsoleLogger:
    """One compact line per step: ``step 12 | critic/score/mean=0.512 actor/pg_loss=-0.0123 … (+40 more)``.

    Args:
        stream: Where lines go (``sys.stdout`` by default, which Ray job logs capture).
        max_metrics: Metrics shown per line; the others are counted. ``None`` shows all.
        first: Names shown first, in order, when present.
    """

    def __init__(
        self, stream: TextIO | None = None, *, max_metrics: int | None = 12, first: Sequence[str] = KEY_METRICS
    ) -> None:
        self._stream = stream or sys.stdout
        self._max = max_metrics
        self._first = tuple(first)

    def format_step(self, metrics: Mapping[str, float], step: int) -> str:
        """The line for one step (without the newline)."""
        items = order_metrics(metrics, first=self._first)
        shown = items if self._max is None else items[: self._max]
        line = f"step {step} | " + " ".join(f"{k}={v:.4g}" for k, v in shown)
        if len(items) > len(shown):
            line += f" (+{len(items) - len(shown)} more)"
        return line

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Print the step's line."""
        self._write(self.format_step(to_float_metrics(metrics, step), step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Print how many params were logged (values are in the other loggers)."""
        self._write(f"params | {len(flatten_config(params))} keys")

    def log_text(self, text: str, artifact_file: str) -> None:
        """Print the artifact's name and size."""
        self._write(f"artifact | {artifact_file} ({len(text)} chars)")

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Print the artifact's name and key count."""
        self._write(f"artifact | {artifact_file} ({len(d)} keys)")

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
        """Print the artifact's name and row count."""
        self._write(f"artifact | {artifact_file} ({len(rows)} rows)")

    def close(self) -> None:
        """Flush the stream (it is not closed: it is usually stdout)."""
        self._stream.flush()


class JsonlLogger:
    """Metrics as JSON lines (``{"step": 3, "timestamp": 1.7e9, "actor/pg_loss": 0.1, ...}``), appended and
    flushed per step, so a crashed run keeps every finished step. Params and artifacts go to files in
    ``artifact_dir`` (default: ``<stem>_artifacts`` next to ``path``), params as ``params.json``.

    Args:
        path: The JSONL file; parent folders are created.
        artifact_dir: Folder for params and artifacts.
    """

    def __init__(self, path: str | Path, *, artifact_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.artifact_dir = Path(artifact_dir) if artifact_dir else self.path.with_name(f"{self.path.stem}_artifacts")
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._params: dict[str, str] = {}

    def _artifact(self, artifact_file: str) -> Path:
        target = (self.artifact_dir / artifact_file).resolve()
        if not target.is_relative_to(self.artifact_dir.resolve()):
            raise ValueError(f"artifact_file {artifact_file!r} escapes the artifact folder; use a relative path")
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append one line for ``step``; NaN and ±inf become ``null``."""
        if self._file is None:
            raise ValueError(f"JsonlLogger({self.path}) is closed; create a new logger")
        values = {k: _finite_or_none(v) for k, v in to_float_metrics(metrics, step).items()}
        record = {"step": step, "timestamp": time.time(), **values}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Merge the flattened params into ``params.json``."""
        self._params.update(flatten_config(params))
        self.log_dict(self._params, "params.json")

    def log_text(self, text: str, artifact_file: str) -> None:
        """Write ``text`` to ``artifact_dir/artifact_file``."""
        self._artifact(artifact_file).write_text(text, encoding="utf-8")

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Write ``d`` as YAML for ``.yaml``/``.yml`` files, JSON otherwise."""
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(dict(d), sort_keys=False)
        else:
            text = json.dumps(d, indent=2, default=str)
        self.log_text(text, artifact_file)

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
        """Write rows in MLflow's table layout (``table_payload``), appending to an existing table as MLflow does."""
        target = self._artifact(artifact_file)
        all_rows = list(rows)
        if target.is_file():
            old = json.loads(target.read_text(encoding="utf-8"))
            all_rows = [dict(zip(old["columns"], values, strict=True)) for values in old["data"]] + all_rows
        self.log_text(json.dumps(table_payload(all_rows), default=str), artifact_file)

    def close(self) -> None:
        """Close the JSONL file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class MultiLogger:
    """Send every call to each logger in order. If some raise, the others still run and the first
    error is raised afterwards, so a tracking-server outage never hides the console/JSONL record."""

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        self.loggers = list(loggers)

    def _fan_out(self, method: str, *args: Any) -> None:
        errors: list[Exception] = []
        for logger in self.loggers:
            try:
                getattr(logger, method)(*args)
            except Exception as exc:  # re-raised below, once every logger ran
                errors.append(exc)
        if errors:
            raise errors[0]

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Fan out ``log_metrics``."""
        self._fan_out("log_metrics", metrics, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Fan out ``log_params``."""
        self._fan_out("log_params", params)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Fan out ``log_text``."""
        self._fan_out("log_text", text, artifact_file)

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Fan out ``log_dict``."""
        self._fan_out("log_dict", d, artifact_file)

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
        """Fan out ``log_table``."""
        self._fan_out("log_table", rows, artifact_file)

    def close(self) -> None:
        """Close every logger."""
        self._fan_out("close")
