"""The pipeline's heavy tasks as Ray jobs: ``prepare_data``, ``fetch_champion``, ``evaluate`` and ``register``.

Each loads a tokenizer or a model, or writes a model into the shared work folder, so it runs on the Ray cluster
(the worker image), never in an Airflow process (no torch there; the scheduler mounts the work folder read-only).
The Airflow side (``rlhf_airflow.task_jobs.RayTaskJobOperator``) submits::

    python -m rlhf_ops.cli pipeline-job <name> --result-dir <work>/jobs/<dag_id>/<run_key>

with the request (JSON: the values the task body used to take from XCom and params) in ``$RLHF_JOB_REQUEST``,
through the same hook and deferrable trigger as ``train``. The job calls the same library function the
in-process task called and writes its result to ``<result-dir>/<submission id>.json``::

    {"status": "ok", "value": {...}}                       the task's return value (the XCom downstream reads)
    {"status": "error", "error": "one line", "retryable": false}   a user mistake (exit code 2)

keyed by the Ray job that wrote it (``RLHF_SUBMISSION_ID`` plus the hook's ``-retry<N>`` suffix), so a retry
never reads an earlier attempt's result, and a re-attach to a finished job reads that job's. Results are never
parsed from logs. Any other exception is a crash (traceback, no result): Airflow retries the task.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.job_results import REQUEST_ENV, current_submission_id, result_path


def _write_result(result_dir: str, submission_id: str, payload: Mapping[str, Any]) -> Path:
    from rlhf_ops.storage.manifest import atomic_write_local

    path = result_path(result_dir, submission_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_local(path, (json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n").encode())
    return path


def _prepare_data(request: Mapping[str, Any]) -> dict[str, Any]:
    from rlhf_ops.pipeline.data import prepare_for_run
    from rlhf_ops.pipeline.layout import RunLayout
    from rlhf_ops.pipeline.params import parse_params

    return prepare_for_run(
        parse_params(request["params"]),
        RunLayout.from_dict(request["layout"]),
        override_policy=request.get("override_policy"),
    )


def _fetch_champion(request: Mapping[str, Any]) -> dict[str, Any]:
    from rlhf_ops.pipeline.layout import RunLayout
    from rlhf_ops.pipeline.register import fetch_champion

    layout = RunLayout.from_dict(request["layout"])
    return fetch_champion(str(request["registered_name"]), models_dir=layout.models_dir)


def _evaluate(request: Mapping[str, Any]) -> dict[str, Any]:
    from rlhf_ops.pipeline.evaluate import evaluate_step
    from rlhf_ops.pipeline.layout import RunLayout

    return evaluate_step(
        int(request["step"]),
        location=str(request["location"]),
        config=request["config"],
        layout=RunLayout.from_dict(request["layout"]),
        mlflow_run_id=request.get("mlflow_run_id"),
        n_samples=int(request["n_samples"]),
        max_prompts=int(request["max_prompts"]),
        engine=str(request.get("engine") or "auto"),
    )


def _register(request: Mapping[str, Any]) -> dict[str, Any]:
    from rlhf_ops.pipeline.layout import RunLayout
    from rlhf_ops.pipeline.promotion import PromotionSpec
    from rlhf_ops.pipeline.register import register_best

    return register_best(
        RunLayout.from_dict(request["layout"]),
        config=request["config"],
        mlflow_run_id=str(request["mlflow_run_id"]),
        registered_name=str(request["registered_name"]),
        metric=str(request["metric"]),
        promotion=PromotionSpec.model_validate(request.get("promotion") or {}),
        eval_n_samples=int(request["eval_n_samples"]),
        eval_max_prompts=int(request["eval_max_prompts"]),
        move=bool(request.get("move", True)),
        engine=str(request.get("engine") or "auto"),
    )


HANDLERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "prepare_data": _prepare_data,
    "fetch_champion": _fetch_champion,
    "evaluate": _evaluate,
    "register": _register,
}


def run_job(name: str, *, result_dir: str, environ: Mapping[str, str] | None = None) -> int:
    """Run heavy task ``name`` on the request in ``$RLHF_JOB_REQUEST``; write its result. Returns the exit code.

    A ``ValueError`` (``ConfigError``, ``DataQualityError``: a user mistake no retry can fix) is written as a
    non-retryable error and exits 2 with one line on stderr; anything else propagates (a crash: retried).
    """
    env = os.environ if environ is None else environ
    submission_id = current_submission_id(env)
    raw = env.get(REQUEST_ENV)
    if not raw:
        raise ValueError(f"${REQUEST_ENV} is empty: the pipeline passes the job's request there")
    request = json.loads(raw)
    try:
        value = HANDLERS[name](request)
    except ValueError as exc:
        message = str(exc)
        _write_result(result_dir, submission_id, {"status": "error", "error": message, "retryable": False})
        print(f"error: {message}", file=sys.stderr)
        return 2
    path = _write_result(result_dir, submission_id, {"status": "ok", "value": value})
    print(f"{name}: result in {path}")
    return 0
