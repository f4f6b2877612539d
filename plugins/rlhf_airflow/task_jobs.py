"""A pipeline task that loads a tokenizer or a model, run as a Ray job: the Airflow side stays torch-free.

``RayTaskJobOperator`` is ``RayJobOperator`` (same hook, idempotent submission id per task instance, deferrable
trigger, re-attach on retry) with a request and a result::

    execute:           build_request(request, context) -> JobRequest  (torch-free: XCom values + params)
                       submit  python -m rlhf_ops.cli pipeline-job <job> --result-dir <dir>,
                       the request as JSON in $RLHF_JOB_REQUEST; defer to RayJobTrigger
    execute_complete:  read <dir>/<submission id>.json (rlhf_ops.pipeline.job_results), never the log;
                       on_result(value, request, context) (Asset event extras), return the value (the XCom)

A job that ends with a user mistake (``{"status": "error", "retryable": false}``: a bad config value, rejected
data) fails the task at once (``AirflowFailException``); a crash, a lost result or a failed poll is an
``AirflowException`` and Airflow retries, re-attaching to a running job or resubmitting as ``-retry<N>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf_airflow.compat import AirflowException, AirflowFailException
from rlhf_airflow.operators import RayJobOperator
from rlhf_ops.pipeline.job_results import REQUEST_ENV, job_entrypoint, read_result, result_path

if TYPE_CHECKING:
    from airflow.sdk import Context


@dataclass(frozen=True, kw_only=True)
class JobRequest:
    """What one heavy task's Ray job receives, and where its result goes."""

    request: dict[str, Any] = field(default_factory=dict)
    """JSON values for the library call (``rlhf_ops.pipeline.jobs``)."""
    result_dir: str
    """A folder the Ray job's driver writes and this Airflow worker reads (the run's ``jobs_dir``)."""
    num_gpus: float | None = None
    """GPUs reserved for the job's driver (the model runs in it); None: none."""


RequestBuilder = Callable[[Mapping[str, Any], "Context"], JobRequest]
ResultHandler = Callable[[dict[str, Any], Mapping[str, Any], "Context"], None]


class RayTaskJobOperator(RayJobOperator):
    """Run the pipeline's heavy task ``job`` (``prepare_data``, ``fetch_champion``, ``evaluate``, ``register``) as a
    Ray job.

    Args:
        job: The ``rlhf pipeline-job`` name.
        request: Values for ``build_request`` (templated: XComArgs resolve to their values at run time).
        build_request: Turns the rendered ``request`` and the context into the job's :class:`JobRequest`; called
            in ``execute`` and again in ``execute_complete`` (deterministic: the same result folder). It may raise
            ``AirflowSkipException`` (nothing to do for this run): then nothing is submitted.
        on_result: Called with the job's result value, the built request and the context before it is returned.
        **kwargs: ``RayJobOperator`` arguments (connections, poll interval, timeout) and ``BaseOperator``'s.
    """

    template_fields: Sequence[str] = (*RayJobOperator.template_fields, "request")
    template_fields_renderers = {**RayJobOperator.template_fields_renderers, "request": "json"}
    ui_color = "#e8f5e9"

    def __init__(
        self,
        *,
        job: str,
        build_request: RequestBuilder,
        request: dict[str, Any] | None = None,
        on_result: ResultHandler | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(entrypoint="", **kwargs)
        self.job = job
        self.request = request
        self.build_request = build_request
        self.on_result = on_result

    def _job_request(self, context: Context) -> JobRequest:
        return self.build_request(dict(self.request or {}), context)

    def execute(self, context: Context) -> Any:
        """Build the request, then submit / re-attach and defer exactly as ``RayJobOperator`` does."""
        spec = self._job_request(context)
        self.entrypoint = job_entrypoint(self.job, spec.result_dir)
        self.env_vars = {**(self.env_vars or {}), REQUEST_ENV: json.dumps(spec.request, default=str)}
        if spec.num_gpus is not None:
            self.entrypoint_num_gpus = spec.num_gpus
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        """Read the job's result file: its value on success, a fail-at-once error for a user mistake.

        Raises:
            AirflowFailException: the job reported a mistake no retry can fix (its one-line message).
            AirflowException: the job failed otherwise, or succeeded without writing a result.
        """
        spec = self._job_request(context)
        submission_id = str(event.get("submission_id", "")) if isinstance(event, Mapping) else ""
        result = read_result(spec.result_dir, submission_id) if submission_id else None
        failed = isinstance(event, Mapping) and event.get("status") != "success"
        if failed and result and result.get("status") == "error" and not result.get("retryable", True):
            raise AirflowFailException(f"{self.job}: {result.get('error')}")
        super().execute_complete(context, event)  # raises for a failed, stopped or timed-out job
        if result is None or result.get("status") != "ok":
            where = result_path(spec.result_dir, submission_id)
            raise AirflowException(
                f"Ray job {submission_id} succeeded but left no result at {where} ({result!r}); "
                "is that folder shared between the Ray head and the Airflow workers?"
            )
        value: dict[str, Any] = result["value"]
        if self.on_result is not None:
            self.on_result(value, spec.request, context)
        return value
