"""Experiment tracking: the ``MetricLogger`` protocol, local loggers, and MLflow integration.

Light modules (no MLflow import) are re-exported here; MLflow-backed pieces live in
``rlhf_ops.tracking.mlflow_tracking`` (``MlflowLogger``, ``start_pipeline_run``…) and
``rlhf_ops.tracking.registry`` (``register_candidate``, ``move_alias``), imported explicitly where needed.
"""

from __future__ import annotations

from rlhf_ops.tracking.logger import ConsoleLogger, JsonlLogger, MetricLogger, MultiLogger, to_float
from rlhf_ops.tracking.params import flatten_config, prepare_params, redact_config, sanitize_key

__all__ = [
    "ConsoleLogger",
    "JsonlLogger",
    "MetricLogger",
    "MultiLogger",
    "flatten_config",
    "prepare_params",
    "redact_config",
    "sanitize_key",
    "to_float",
]
