"""The torch-free channel between a heavy task and its Ray job (:mod:`rlhf_ops.pipeline.jobs`): the entrypoint, and
where the job's result travels. The Airflow side imports only this module and :mod:`rlhf_ops.pipeline.job_requests`.

Nothing travels through a folder that both sides mount:

* the request goes out in the Ray job's ``$RLHF_JOB_REQUEST`` (the Jobs API, so it never holds a secret);
* the result comes back through the run's remote store when it has one
  (``<remote_store_url>/<dag_id>/<run_key>/jobs/<submission id>.json``, read with the Airflow side's own store
  credentials), else as the job's last log line, ``RLHF_JOB_RESULT {...}``, read through the Jobs API
  (``get_job_logs``). The line is tagged with the submission id, so a user's print cannot pose as a result.

A result is ``{"status": "ok", "value": {...}}`` or ``{"status": "error", "error": "one line", "retryable": false}``
(a user mistake), keyed by the Ray job that wrote it (``RLHF_SUBMISSION_ID`` plus the hook's ``-retry<N>`` suffix),
so a retry never reads an earlier attempt's result and a re-attach to a finished job reads that job's.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from rlhf_ops.pipeline.job_requests import job_entry

REQUEST_ENV = "RLHF_JOB_REQUEST"
SUBMISSION_ENV = "RLHF_SUBMISSION_ID"  # set by RayJobOperator: the base id, the same on every try
RETRY_INDEX_ENV = "RLHF_RETRY_INDEX"  # set by RayJobHook on a -retry<N> submission
SHIPPED_MODULES_ENV = "RLHF_SHIPPED_MODULES"  # the run's shipped top-level modules (rlhf_ops.code_policy reads it too)
RESULT_TAG = "RLHF_JOB_RESULT"
CLI_MODULE = "rlhf_ops.cli"


def job_entrypoint(name: str) -> str:
    """The Ray job's shell command for heavy job ``name`` (each word quoted).

    Raises:
        ValueError: ``name`` is not in the job table.
    """
    job_entry(name)
    return " ".join(shlex.quote(word) for word in ["python", "-m", CLI_MODULE, "pipeline-job", name])


def result_url(remote_run_url: str, submission_id: str) -> str:
    """Where job ``submission_id`` of a run with a remote store leaves its result."""
    return f"{remote_run_url.rstrip('/')}/jobs/{submission_id}.json"


def result_line(submission_id: str, payload: Mapping[str, Any]) -> str:
    """The tagged log line that carries a result when the run has no remote store (one line of JSON)."""
    return f"{RESULT_TAG} {submission_id} {json.dumps(payload, sort_keys=True, default=str)}"


def result_from_logs(logs: str, submission_id: str) -> dict[str, Any] | None:
    """The result in the last tagged line of job ``submission_id``'s log, or None when it printed none."""
    prefix = f"{RESULT_TAG} {submission_id} "
    for line in reversed(logs.splitlines()):
        if line.startswith(prefix):
            try:
                data = json.loads(line[len(prefix) :])
            except ValueError:
                return {"status": "error", "error": "the job's result line is not valid JSON", "retryable": True}
            return data if isinstance(data, dict) else None
    return None


def read_result(submission_id: str, *, remote_run_url: str | None, logs: Callable[[], str]) -> dict[str, Any] | None:
    """The result job ``submission_id`` left (store first, then its log), or None when it left none.

    Args:
        submission_id: The Ray job.
        remote_run_url: The run's remote folder (None: the run has no remote store).
        logs: Returns the job's whole log (``RayJobHook.logs``); called only when the store holds no result.
    """
    if remote_run_url:
        from rlhf_ops.storage import open_store

        fs, path = open_store(result_url(remote_run_url, submission_id))
        fs.invalidate_cache()
        if fs.exists(path):
            with fs.open(path, "rb") as f:
                data = json.loads(f.read())
            return data if isinstance(data, dict) else None
    return result_from_logs(logs(), submission_id)


def current_submission_id(environ: Mapping[str, str] | None = None) -> str:
    """This job's Ray submission id, as ``RayJobHook.submit`` named it (base id, ``-retry<N>`` on a retry).

    Raises:
        ValueError: ``RLHF_SUBMISSION_ID`` is not set (the command runs outside a pipeline Ray job).
    """
    env = os.environ if environ is None else environ
    base = env.get(SUBMISSION_ENV)
    if not base:
        raise ValueError(f"${SUBMISSION_ENV} is not set: pipeline-job runs as a Ray job submitted by the pipeline")
    retry = env.get(RETRY_INDEX_ENV)
    return f"{base}-retry{retry}" if retry else base
