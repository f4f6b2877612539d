"""Where one pipeline run keeps its files, derived from the Airflow run id so that every retry finds them.

Under the Ray cluster's work folder (e.g. ``/data/rlhf`` on each node, or a cluster volume)::

    data/<dag_id>/<run_key>/                   prepare_data's train.parquet, val.parquet, rejected.jsonl, manifest
    checkpoints/<dag_id>/<run_key>/            the trainer's run folder (trainer.checkpoint_root/experiment/run)
        global_step_<N>/                       a committed checkpoint (MANIFEST.json), + eval.json once evaluated
        exports/global_step_<N>/               HF export used by evaluation and register_model
        metrics.jsonl                          the trainer's JSONL metrics
    models/<registered name>/v<version>/       a champion downloaded for a warm start
    cache/<dag_id>/<run_key>/                  checkpoints downloaded from the remote store

and, when ``remote_store_url`` is set, ``<remote_store_url>/<dag_id>/<run_key>/global_step_<N>/`` and
``.../jobs/<submission id>.json`` (each heavy job's result, :mod:`rlhf_ops.pipeline.job_results`).

The work folder is the Ray cluster's: the heavy jobs resolve it on their side (``params.work_dir`` or the Ray
node's ``$RLHF_WORK_DIR``) and Airflow workers never read it, so the two share no disk when the run has a remote
store (the checkpoints' sensor and the results go through it). Without one, the sensor looks at the work folder and
the work folder must be shared (the all-in-one stack).

``run_key`` turns an Airflow run id (``manual__2026-11-29T10:00:00.123+00:00``) into a folder name that every
store accepts (no ``:`` or ``+``, which HDFS and some S3 tools reject), with a digest so that two run ids
never share a folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORK_DIR_ENV = "RLHF_WORK_DIR"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def run_key(run_id: str) -> str:
    """Folder-safe, unique key of an Airflow run id.

    Example: ``"manual__2026-11-29T10:00:00+00:00"`` → ``"manual__2026-11-29T10-00-00-00-00-<8 hex>"``.
    """
    if not run_id:
        raise ValueError("run_id is empty; pass the Airflow run id (context['run_id'])")
    body = _UNSAFE.sub("-", run_id).strip("-.")[:80]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{body}-{digest}" if body else digest


def resolve_work_dir(work_dir: str | None) -> Path:
    """The absolute work folder: ``work_dir`` or ``$RLHF_WORK_DIR``.

    Raises:
        ValueError: neither is set.
    """
    value = work_dir or os.environ.get(WORK_DIR_ENV)
    if not value:
        raise ValueError(
            f"work_dir is not set: pass params.work_dir or set ${WORK_DIR_ENV} on the Ray nodes to a folder the "
            "pipeline's jobs can write"
        )
    return Path(value).expanduser().absolute()


@dataclass(frozen=True, kw_only=True)
class RunLayout:
    """Paths of one pipeline run (all strings, so the object round-trips through XCom as a dict)."""

    work_dir: str
    dag_id: str
    run_key: str
    data_root: str
    """``prepare_dataset``'s ``out_url``; the run's files are in ``<data_root>/<run_key>/``."""
    checkpoint_root: str
    """``trainer.checkpoint_root``."""
    experiment: str
    """``trainer.experiment_name`` (the DAG id)."""
    local_run_dir: str
    """``<checkpoint_root>/<experiment>/<run_key>``."""
    remote_run_url: str | None
    """``<remote_store_url>/<experiment>/<run_key>``, or None without a remote store."""
    cache_dir: str
    models_dir: str

    @classmethod
    def for_run(
        cls, *, dag_id: str, run_id: str, work_dir: str | None, remote_store_url: str | None = None
    ) -> RunLayout:
        """The layout of Airflow run ``run_id`` of ``dag_id``."""
        root = resolve_work_dir(work_dir)
        key = run_key(run_id)
        checkpoint_root = root / "checkpoints"
        remote = f"{remote_store_url.rstrip('/')}/{dag_id}/{key}" if remote_store_url else None
        return cls(
            work_dir=str(root),
            dag_id=dag_id,
            run_key=key,
            data_root=str(root / "data" / dag_id),
            checkpoint_root=str(checkpoint_root),
            experiment=dag_id,
            local_run_dir=str(checkpoint_root / dag_id / key),
            remote_run_url=remote,
            cache_dir=str(root / "cache" / dag_id / key),
            models_dir=str(root / "models"),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunLayout:
        """Inverse of :meth:`to_dict` (an XCom value)."""
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return asdict(self)

    def export_dir(self, step: int) -> Path:
        """Where the HF export of ``global_step_<step>`` goes."""
        return Path(self.local_run_dir) / "exports" / f"global_step_{step}"

    @property
    def checkpoint_url(self) -> str:
        """The folder to show users: the remote run folder when there is one, else the local one."""
        return self.remote_run_url or Path(self.local_run_dir).as_uri()


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block, then restore the previous values.

    Tasks run library code in their own process in production; under ``dag.test()`` they share the test
    process, so credentials taken from Airflow connections must not outlive the task.
    """
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
