"""The Ray side of the pipeline's heavy jobs: ``rlhf pipeline-job <name>`` (``job_requests.PIPELINE_JOBS``).

Each loads a tokenizer or a model, or reads and writes the run's folders, so it runs on the Ray cluster (the worker
image), never in an Airflow process. ``rlhf_airflow.task_jobs.RayTaskJobOperator`` submits::

    python -m rlhf_ops.cli pipeline-job <name>

with the typed request (:mod:`rlhf_ops.pipeline.job_requests`) as JSON in ``$RLHF_JOB_REQUEST``. The job

1. imports the run's shipped code (``$RLHF_SHIPPED_MODULES``): a module that fails to import ends the job at once
   with one line naming it and the fix;
2. parses the request (an unknown ``schema_version`` is one line);
3. calls the job's body (its entry in the table: a built-in of :mod:`rlhf_ops.pipeline.heavy`, an entry point, or
   a dotted path to a user's job) and leaves its result where :mod:`rlhf_ops.pipeline.job_results` says (the run's
   remote store, or a tagged last log line).

A ``ValueError`` (``ConfigError``, ``DataQualityError``, the two checks above: a user mistake no retry can fix) is a
non-retryable error result and exit code 2 with one line on stderr; anything else propagates (a crash: retried).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from rlhf_ops.pipeline.job_requests import RunRef, job_entry, parse_request
from rlhf_ops.pipeline.job_results import (
    REQUEST_ENV,
    SHIPPED_MODULES_ENV,
    current_submission_id,
    result_line,
    result_url,
)


def check_shipped_modules(environ: Mapping[str, str]) -> None:
    """Import each module the run ships (``$RLHF_SHIPPED_MODULES``, comma-separated).

    Raises:
        ValueError: one line naming the module that does not import and the fix.
    """
    for name in filter(None, (m.strip() for m in environ.get(SHIPPED_MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or the module's own code raising while it is imported
            raise ValueError(
                f"shipped module {name!r} does not import ({type(exc).__name__}: {exc}); fix the module, or add the "
                "package it needs to the run's code.pip"
            ) from None


def _leave_result(payload: Mapping[str, Any], *, submission_id: str, remote_run_url: str | None) -> str:
    """Write the result to the run's remote store (or print it as the tagged last log line); returns where."""
    if remote_run_url:
        from rlhf_ops.storage import open_store

        url = result_url(remote_run_url, submission_id)
        fs, path = open_store(url)
        with fs.open(path, "wb") as f:  # one PUT on object stores: a reader sees all of it or nothing
            f.write((json.dumps(payload, sort_keys=True, default=str) + "\n").encode())
        return url
    print(result_line(submission_id, payload), flush=True)
    return "the job's log"


def _remote_run_url(raw: str | None) -> str | None:
    """The run's remote folder from the raw request, for an error result before the request validates."""
    try:
        return RunRef.model_validate(json.loads(raw or "{}")["run"]).remote_run_url
    except Exception:  # a request too broken to name its run: the error goes to the log
        return None


def run_job(name: str, *, environ: Mapping[str, str] | None = None) -> int:
    """Run heavy job ``name`` on the request in ``$RLHF_JOB_REQUEST``; leave its result. Returns the exit code."""
    env = os.environ if environ is None else environ
    submission_id = current_submission_id(env)
    raw = env.get(REQUEST_ENV)
    remote = _remote_run_url(raw)
    try:
        check_shipped_modules(env)  # first: a shipped job's own module must import
        entry = job_entry(name)
        if not raw:
            raise ValueError(f"${REQUEST_ENV} is empty: the pipeline passes the job's request there")
        request = parse_request(name, raw)
        remote = request.run.remote_run_url
        value = entry.result.model_validate(entry.run(request)).model_dump(mode="json")
    except ValueError as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        _leave_result(
            {"status": "error", "error": message, "retryable": False},
            submission_id=submission_id,
            remote_run_url=remote,
        )
        print(f"error: {message}", file=sys.stderr)
        return 2
    where = _leave_result({"status": "ok", "value": value}, submission_id=submission_id, remote_run_url=remote)
    print(f"{name}: result in {where}")
    return 0
