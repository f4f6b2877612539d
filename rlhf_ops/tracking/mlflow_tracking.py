"""MLflow side of tracking: the pipeline run's lifecycle and ``MlflowLogger``.

One MLflow run per pipeline run. Airflow's ``start_tracking`` task calls ``start_pipeline_run`` (idempotent
per DAG run, so a retried task finds the same run) and passes the id on as ``MLFLOW_RUN_ID``; the Ray
driver's rank 0 attaches with ``MlflowLogger()``; ``end_pipeline_run`` closes it.

Everything goes through ``MlflowClient`` with an explicit ``run_id``; the fluent API (``mlflow.start_run``,
active runs) is never used, because the run is created in one process and logged to from others. For
the same reason system metrics are not switched on with ``mlflow.enable_system_metrics_logging()``
(which only acts inside ``mlflow.start_run``): ``MlflowLogger`` runs MLflow's ``SystemMetricsMonitor``
thread itself against the attached run id, resuming the ``system/*`` step counter where it stopped.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from rlhf_ops.tracking.logger import to_float_metrics
from rlhf_ops.tracking.metric_buffer import BufferReport, MetricBuffer
from rlhf_ops.tracking.params import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VALUE_LENGTH,
    OVERFLOW_ARTIFACT,
    chunked,
    prepare_params,
    redact_config,
    redact_value,
    sanitize_keys,
)

__all__ = [
    "ENV_RUN_ID",
    "MlflowLogger",
    "end_pipeline_run",
    "pipeline_tags",
    "platform_git_commit",
    "run_name_for",
    "set_run_tags",
    "start_pipeline_run",
]

_log = logging.getLogger(__name__)

ENV_RUN_ID = "MLFLOW_RUN_ID"
ENV_GIT_COMMIT = "RLHF_OPS_GIT_COMMIT"  # set at image build time, where there is no .git folder
TAG_DAG_ID = "airflow.dag_id"
TAG_DAG_RUN_ID = "airflow.run_id"
TAG_TRY_NUMBER = "airflow.try_number"
TAG_RAY_SUBMISSION_ID = "ray.submission_id"
TAG_GIT_COMMIT = "rlhf.git_commit"
TAG_MLFLOW_GIT_COMMIT = "mlflow.source.git.commit"  # shown by the MLflow UI


def platform_git_commit() -> str:
    """The git commit of the installed ``rlhf_ops`` source, or ``"unknown"``.

    Order: ``$RLHF_OPS_GIT_COMMIT`` (container images), then ``git rev-parse HEAD`` in the package folder,
    accepted only if git tracks the package there (a wheel inside some other repo's ``.venv`` is not).
    """
    if commit := os.environ.get(ENV_GIT_COMMIT, "").strip():
        return commit
    pkg_dir = Path(__file__).resolve().parents[1]
    try:
        tracked = subprocess.run(
            ["git", "-C", str(pkg_dir), "ls-files", "--error-unmatch", "__init__.py"],
            capture_output=True,
            timeout=10,
        )
        head = subprocess.run(
            ["git", "-C", str(pkg_dir), "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if tracked.returncode != 0 or head.returncode != 0:
        return "unknown"
    return head.stdout.strip() or "unknown"


def run_name_for(preset: str, algorithm: str, date: dt.datetime, key: str | None = None) -> str:
    """Run name ``"<preset>/<algorithm>/<YYYY-MM-DDTHH:MM>[/<key>]"``, e.g. ``"tiny-cpu/grpo/2026-11-29T10:00"``.

    An aware ``date`` is shown in UTC; a naive one as it is (Airflow's logical dates are aware UTC). ``key``
    (the pipeline passes its run key's digest) tells apart runs started in the same minute.
    """
    if date.tzinfo is not None:
        date = date.astimezone(dt.UTC)
    name = f"{preset}/{algorithm}/{date:%Y-%m-%dT%H:%M}"
    return f"{name}/{key}" if key else name


def pipeline_tags(
    *, dag_id: str, dag_run_id: str, try_number: int, ray_submission_id: str | None = None
) -> dict[str, str]:
    """The standard tags that link an MLflow run to its Airflow run and Ray job."""
    tags = {TAG_DAG_ID: dag_id, TAG_DAG_RUN_ID: dag_run_id, TAG_TRY_NUMBER: str(try_number)}
    if ray_submission_id:
        tags[TAG_RAY_SUBMISSION_ID] = ray_submission_id
    return tags


def _clean_tags(tags: Mapping[str, Any]) -> dict[str, str]:
    # Tag values are capped at 8000 characters by MLflow; credentials in URLs are masked.
    return {k: redact_value(str(v))[:MAX_TAG_VALUE_LENGTH] for k, v in sanitize_keys(tags, what="tags").items()}


def _experiment_id(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name)
        except MlflowException as exc:  # another task created it meanwhile
            if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
            experiment = client.get_experiment_by_name(name)
            assert experiment is not None
    if experiment.lifecycle_stage == "deleted":
        raise ValueError(
            f"experiment {name!r} is deleted in MLflow; restore it (`mlflow experiments restore`) or pick another name"
        )
    return str(experiment.experiment_id)


def _find_pipeline_run(client: MlflowClient, experiment_id: str, tags: Mapping[str, str]) -> str | None:
    dag_id, dag_run_id = tags.get(TAG_DAG_ID), tags.get(TAG_DAG_RUN_ID)
    if not dag_id or not dag_run_id or "'" in dag_id + dag_run_id:
        return None  # no identity to match on (or one the filter language cannot quote)
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{TAG_DAG_ID}` = '{dag_id}' AND tags.`{TAG_DAG_RUN_ID}` = '{dag_run_id}'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    return found[0].info.run_id if found else None


def start_pipeline_run(*, tracking_uri: str | None, experiment: str, run_name: str, tags: Mapping[str, Any]) -> str:
    """Create (or find again) the MLflow run of one pipeline run and return its id.

    The experiment is created when missing. When ``tags`` hold ``airflow.dag_id`` and ``airflow.run_id``
    (see ``pipeline_tags``), an active run with the same two tags is reused, so a retried Airflow task
    does not create a second run; its tags are updated (try number) and it is set back to RUNNING.
    ``rlhf.git_commit`` and ``mlflow.source.git.commit`` are added from ``platform_git_commit()``.

    Args:
        tracking_uri: MLflow server URI; ``None`` uses ``$MLFLOW_TRACKING_URI``.
        experiment: Experiment name.
        run_name: Display name, see ``run_name_for``.
        tags: Extra run tags; keys are sanitised, values stringified.

    Returns:
        The run id (export it to later tasks as ``MLFLOW_RUN_ID``).
    """
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = _experiment_id(client, experiment)
    commit = platform_git_commit()
    all_tags = {**_clean_tags(tags), TAG_GIT_COMMIT: commit}
    if commit != "unknown":
        all_tags[TAG_MLFLOW_GIT_COMMIT] = commit
    run_id = _find_pipeline_run(client, experiment_id, all_tags)
    if run_id is None:
        return str(client.create_run(experiment_id, run_name=run_name, tags=all_tags).info.run_id)
    _log.info("Reusing MLflow run %s of %s/%s", run_id, all_tags[TAG_DAG_ID], all_tags[TAG_DAG_RUN_ID])
    set_run_tags(tracking_uri=tracking_uri, run_id=run_id, tags=all_tags)
    if client.get_run(run_id).info.status != RunStatus.to_string(RunStatus.RUNNING):
        client.update_run(run_id, status="RUNNING")
    return run_id


def set_run_tags(*, tracking_uri: str | None, run_id: str, tags: Mapping[str, Any]) -> None:
    """Set (or overwrite) run tags, e.g. ``ray.submission_id`` once the Ray job is submitted."""
    client = MlflowClient(tracking_uri=tracking_uri)
    entities = [RunTag(k, v) for k, v in _clean_tags(tags).items()]
    for batch in chunked(entities, MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, tags=batch)


def end_pipeline_run(*, tracking_uri: str | None, run_id: str, status: str = "FINISHED") -> None:
    """Terminate the run with ``status`` (``FINISHED``, ``FAILED`` or ``KILLED``)."""
    if status not in ("FINISHED", "FAILED", "KILLED"):
        raise ValueError(f"end_pipeline_run: status must be FINISHED, FAILED or KILLED, got {status!r}")
    MlflowClient(tracking_uri=tracking_uri).set_terminated(run_id, status=status)


class MlflowLogger:
    """``MetricLogger`` that logs to an existing MLflow run; on ranks other than 0 every call is a no-op.

    Attaching sets a terminated run back to RUNNING (a retried training task resumes its run). Metrics,
    params and tags are sent with ``MlflowClient.log_batch`` in chunks within MLflow's limits (1000
    metrics, 100 params or tags, 1000 entities per request). ``close`` stops the system-metrics thread
    but leaves the run open: the pipeline ends it with ``end_pipeline_run``.

    With ``buffered=True`` (``rlhf train``) metrics go through a ``MetricBuffer``: if the server stops answering
    mid-run, training goes on, the values are kept (up to ``max_buffered_metrics``) and sent in order when it is
    back; ``close`` waits up to ``flush_timeout_s`` for them and logs one line naming what was never sent
    (``buffer_report`` holds the figures). Without it a failed request raises, as MLflow's client does.

    Args:
        run_id: Run to attach to; ``None`` reads ``$MLFLOW_RUN_ID``.
        tracking_uri: MLflow server URI; ``None`` uses ``$MLFLOW_TRACKING_URI``.
        rank: This process's rank; only rank 0 talks to MLflow.
        log_system_metrics: Run MLflow's CPU/memory/disk/network/GPU monitor (needs ``psutil``).
        system_metrics_interval_s: Sampling interval of that monitor.
        buffered: Survive server outages mid-run (see above).
        max_buffered_metrics: Most metric values kept during an outage; the oldest are dropped beyond it.
        flush_timeout_s: How long ``close`` waits for buffered values to be sent.
    """

    def __init__(
        self,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        rank: int = 0,
        log_system_metrics: bool = True,
        system_metrics_interval_s: float = 10.0,
        buffered: bool = False,
        max_buffered_metrics: int = 100_000,
        flush_timeout_s: float = 120.0,
    ) -> None:
        self.rank = rank
        self.run_id = run_id or os.environ.get(ENV_RUN_ID) or ""
        self._overflow: dict[str, str] = {}
        self._monitor: Any = None
        self._client: MlflowClient | None = None
        self._buffer: MetricBuffer | None = None
        self._system_metrics_interval_s = system_metrics_interval_s
        self.flush_timeout_s = flush_timeout_s
        self.buffer_report: BufferReport | None = None
        if rank != 0:
            return
        if not self.run_id:
            raise ValueError(f"MlflowLogger: no run id; pass run_id= or set ${ENV_RUN_ID} (from start_pipeline_run)")
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = self._client.tracking_uri
        info = self._client.get_run(self.run_id).info  # fails fast on a wrong id or server
        if info.lifecycle_stage == "deleted":
            raise ValueError(f"MlflowLogger: run {self.run_id} is deleted; restore it or start a new pipeline run")
        if info.status != RunStatus.to_string(RunStatus.RUNNING):
            self._client.update_run(self.run_id, status="RUNNING")
        if log_system_metrics:
            self._monitor = _start_system_metrics(self.run_id, self.tracking_uri, system_metrics_interval_s)
        if buffered:
            client, run = self._client, self.run_id
            self._buffer = MetricBuffer(
                lambda batch: client.log_batch(run, metrics=batch),
                where=f"MLflow at {redact_value(self.tracking_uri)}",
                probe=_health_probe(self.tracking_uri),
                is_permanent=_is_refusal,
                max_values=max_buffered_metrics,
                batch_size=MAX_METRICS_PER_BATCH,
                on_recover=self._restart_system_metrics,
            )

    @property
    def active(self) -> bool:
        """Whether this logger sends anything (rank 0 and not closed)."""
        return self._client is not None

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step's metrics; keys are sanitised (``acc@1`` → ``acc_1``), values made ``float``."""
        if self._client is None:
            return
        values = sanitize_keys(to_float_metrics(metrics, step), what="log_metrics")
        timestamp_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
        entities = [Metric(k, v, timestamp_ms, step) for k, v in values.items()]
        if self._buffer is not None:
            self._buffer.add(entities, step=step)
            return
        for batch in chunked(entities, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log a nested config as flat, redacted params; values over 6000 chars go to ``params_overflow.json``.

        Logging the same key again with the same value is fine; with another value MLflow raises.
        """
        if self._client is None:
            return
        flat, overflow = prepare_params(params)
        if overflow:  # artifact first, so a pointer never refers to a missing file
            self._overflow.update(overflow)
            self._client.log_dict(self.run_id, self._overflow, OVERFLOW_ARTIFACT)
        entities = [Param(k, v) for k, v in flat.items()]
        for batch in chunked(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=batch)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (keys sanitised, values stringified)."""
        if self._client is not None:
            set_run_tags(tracking_uri=self.tracking_uri, run_id=self.run_id, tags=tags)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file``."""
        if self._client is not None:
            self._client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Store ``d`` (redacted) as JSON, or YAML when ``artifact_file`` ends in ``.yaml``/``.yml``."""
        if self._client is not None:
            self._client.log_dict(self.run_id, redact_config(d), artifact_file)

    def log_table(self, rows: Sequence[Mapping[str, Any]], artifact_file: str) -> None:
        """Store rows as an MLflow table (``.json``, shown in the UI's evaluation view); appends to an existing one."""
        if not artifact_file.endswith(".json"):
            raise ValueError(f"log_table: artifact_file must end in .json, got {artifact_file!r}")
        if self._client is None:
            return
        import pandas as pd

        self._client.log_table(self.run_id, data=pd.DataFrame([dict(r) for r in rows]), artifact_file=artifact_file)

    def log_model_dir(self, hf_dir: str | Path, *, artifact_path: str = "model") -> str | None:
        """Upload a Hugging Face model folder (config, safetensors, tokenizer) as plain artifacts.

        Returns:
            ``runs:/<run_id>/<artifact_path>``, the source of a registered version
            (``registry.register_candidate``); ``None`` on rank != 0.
        """
        hf_path = Path(hf_dir)
        if not hf_path.is_dir():
            raise ValueError(f"log_model_dir: hf_dir {str(hf_path)!r} is not a folder; pass the HF export folder")
        if not (hf_path / "config.json").is_file():
            _log.warning("log_model_dir: %s has no config.json; from_pretrained will not load it", hf_path)
        if self._client is None:
            return None
        self._client.log_artifacts(self.run_id, str(hf_path), artifact_path=artifact_path)
        return f"runs:/{self.run_id}/{artifact_path}"

    def log_mlflow_model(self, hf_dir: str | Path, *, artifact_path: str = "model") -> str | None:
        """Log an HF export folder as an MLflow Model (transformers flavour, not loaded; see ``mlflow_model``).

        Returns:
            ``runs:/<run_id>/<artifact_path>``, loadable with ``mlflow.pyfunc.load_model``; ``None`` on rank != 0.
        """
        import tempfile

        from rlhf_ops.tracking.mlflow_model import save_transformers_model

        if self._client is None:
            return None
        with tempfile.TemporaryDirectory(prefix="mlflow-model-") as tmp:
            model = save_transformers_model(hf_dir, Path(tmp) / "model")
            self._client.log_artifacts(self.run_id, str(model), artifact_path=artifact_path)
        return f"runs:/{self.run_id}/{artifact_path}"

    def close(self) -> None:
        """Send buffered metrics (up to ``flush_timeout_s``), stop the system-metrics thread (flushing its last
        samples); the run itself stays open."""
        if self._buffer is not None:
            self.buffer_report = self._buffer.close(self.flush_timeout_s)
            self._buffer = None
        if self._monitor is not None:
            _finish_system_metrics(self._monitor)
            self._monitor = None
        self._client = None

    def _restart_system_metrics(self) -> None:
        """After an outage: MLflow's monitor thread ends when a request fails, so start a new one (it resumes
        the ``system/*`` step counter)."""
        old = self._monitor
        thread = getattr(old, "_process", None)  # the monitor's thread (MLflow names it so)
        if old is None or self._client is None or (thread is not None and thread.is_alive()):
            return
        self._monitor = _start_system_metrics(self.run_id, self.tracking_uri, self._system_metrics_interval_s)


def _is_refusal(exc: BaseException) -> bool:
    """Whether MLflow refused a request (HTTP 4xx but 408 / 429): retrying it cannot help."""
    if not isinstance(exc, MlflowException):
        return False
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status not in (408, 429)


def _health_probe(tracking_uri: str) -> Any:
    """``GET <uri>/health`` with a short timeout for an HTTP server (any answer below 500 means it is up);
    ``None`` for other stores (files, databases), which have no outage of their own."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    import requests

    url = tracking_uri.rstrip("/") + "/health"
    session = requests.Session()  # keep-alive: one probe per batch costs a few ms

    def probe() -> bool:
        try:
            return session.get(url, timeout=5).status_code < 500
        except requests.RequestException:
            return False

    return probe


def _finish_system_metrics(monitor: Any, timeout_s: float = 30.0) -> None:
    """``monitor.finish()``, waiting at most ``timeout_s``: its thread may sit in MLflow's retries for minutes
    when the server is away."""
    done = threading.Thread(target=monitor.finish, name="rlhf-system-metrics-finish", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        _log.warning(
            "the system-metrics thread did not stop within %.0f s (MLflow not answering); left behind", timeout_s
        )


def _start_system_metrics(run_id: str, tracking_uri: str, interval_s: float) -> Any:
    """Start MLflow's system-metrics thread for ``run_id``; ``None`` (with a warning) when psutil is missing."""
    try:
        import psutil  # noqa: F401  - required by the CPU/memory monitors
    except ImportError:
        _log.warning("psutil is not installed; system metrics are off (pip install psutil)")
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=interval_s, resume_logging=True, tracking_uri=tracking_uri
    )
    monitor.start()
    return monitor
