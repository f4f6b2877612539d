"""The torch-free half of the heavy tasks' Ray jobs (:mod:`rlhf_ops.pipeline.jobs`): names, the entrypoint,
where a job's result lies and how to read it. The Airflow side imports only this module.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REQUEST_ENV = "RLHF_JOB_REQUEST"
SUBMISSION_ENV = "RLHF_SUBMISSION_ID"  # set by RayJobOperator: the base id, the same on every try
RETRY_INDEX_ENV = "RLHF_RETRY_INDEX"  # set by RayJobHook on a -retry<N> submission
CLI_MODULE = "rlhf_ops.cli"
JOB_NAMES = ("prepare_data", "fetch_champion", "evaluate", "register")


def job_entrypoint(name: str, result_dir: str) -> str:
    """The Ray job's shell command for heavy task ``name`` (each word quoted)."""
    if name not in JOB_NAMES:
        raise ValueError(f"job {name!r} is not a pipeline job; choose one of {list(JOB_NAMES)}")
    words = ["python", "-m", CLI_MODULE, "pipeline-job", name, "--result-dir", result_dir]
    return " ".join(shlex.quote(word) for word in words)


def result_path(result_dir: str | os.PathLike[str], submission_id: str) -> Path:
    """Where the job with ``submission_id`` writes its result."""
    return Path(result_dir) / f"{submission_id}.json"


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


def read_result(result_dir: str | os.PathLike[str], submission_id: str) -> dict[str, Any] | None:
    """The result the job ``submission_id`` wrote, or None when it wrote none (it crashed, or is not done)."""
    path = result_path(result_dir, submission_id)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # written atomically, so only a foreign file can be half-written
        return {"status": "error", "error": f"{path} is not valid JSON", "retryable": True}
    return data if isinstance(data, dict) else None
