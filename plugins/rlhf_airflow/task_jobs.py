"""A pipeline task that loads a tokenizer or a model, or reads the run's folders, run as a Ray job: the Airflow side
stays torch-free and shares no disk with the cluster.

``RayTaskJobOperator`` is ``RayJobOperator`` (same hook, idempotent submission id per task instance, deferrable
trigger, re-attach on retry) with a typed request and a result::

    execute:           build_request(request, context) -> JobSpec  (a request model of rlhf_ops.pipeline.job_requests)
                       submit  python -m rlhf_ops.cli pipeline-job <job>, the request as JSON in $RLHF_JOB_REQUEST;
                       defer to RayJobTrigger
    execute_complete:  read the job's result (rlhf_ops.pipeline.job_results: the run's remote store, else the job's
                       tagged last log line through the Jobs API); on_result(value, request, context) (Asset event
                       extras), return the value (the XCom)

A job that ends with a user mistake (``{"status": "error", "retryable": false}``: a bad config value, rejected
data, shipped code that does not import, a request version the cluster's library does not read) fails the task at
once (``AirflowFailException``); a crash, a lost result or a failed poll is an ``AirflowException`` and Airflow
retries, re-attaching to a running job or resubmitting as ``-retry<N>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf_airflow.compat import AirflowException, AirflowFailException
from rlhf_airflow.operators import MAX_LOST_RESUBMITS, RayJobOperator
from rlhf_ops.pipeline.job_requests import JobRequest, job_entry, validate_result
from rlhf_ops.pipeline.job_results import REQUEST_ENV, job_entrypoint, read_result

if TYPE_CHECKING:
    from airflow.sdk import Context


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What one heavy task's Ray job receives."""

    request: JobRequest
    """The typed request (its model is the job's entry in ``rlhf_ops.pipeline.job_requests.JOBS``)."""
    num_gpus: float | None = None
    """GPUs reserved for the job's driver (the model runs in it); None: none."""


RequestBuilder = Callable[[Mapping[str, Any], "Context"], JobSpec]
ResultHandler = Callable[[dict[str, Any], Any, "Context"], None]


class RayTaskJobOperator(RayJobOperator):
    """Run the pipeline's heavy job ``job`` (an entry of ``rlhf_ops.pipeline.job_requests.JOBS``) as a Ray job.

    Args:
        job: The job's name in the table.
        request: Values for ``build_request`` (templated: XComArgs resolve to their values at run time).
        build_request: Turns the rendered ``request`` and the context into the job's :class:`JobSpec`; called in
            ``execute`` and again in ``execute_complete`` (deterministic). It may raise ``AirflowSkipException``
            (nothing to do for this run): then nothing is submitted.
        on_result: Called with the job's result value, the request model and the context before it is returned.
        **kwargs: ``RayJobOperator`` arguments (connections, code policy, poll interval, timeout) and
            ``BaseOperator``'s (``multiple_outputs`` pushes each key of the result as its own XCom).
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
        super().__init__(entrypoint=job_entrypoint(job), **kwargs)
        self.job = job
        self.request = request
        self.build_request = build_request
        self.on_result = on_result

    def _job_spec(self, context: Context) -> JobSpec:
        spec = self.build_request(dict(self.request or {}), context)
        wanted = job_entry(self.job).request
        if not isinstance(spec.request, wanted):
            raise TypeError(
                f"{self.task_id}: build_request gave a {type(spec.request).__name__}, not a {wanted.__name__}"
            )
        return spec

    def execute(self, context: Context, *, resume: bool = False, lost: int = 0) -> Any:
        """Build the request, then submit / re-attach and defer exactly as ``RayJobOperator`` does."""
        spec = self._job_spec(context)
        self.env_vars = {**(self.env_vars or {}), REQUEST_ENV: spec.request.model_dump_json()}
        if spec.num_gpus is not None:
            self.entrypoint_num_gpus = spec.num_gpus
        return super().execute(context, resume=resume, lost=lost)

    def _read_result(self, spec: JobSpec, submission_id: str) -> dict[str, Any] | None:
        from rlhf_airflow.hooks import worker_env_from_connections
        from rlhf_ops.pipeline.layout import patched_environ

        remote = spec.request.run.remote_run_url
        store_env = worker_env_from_connections(s3_conn_id=self.s3_conn_id) if remote and self.s3_conn_id else {}
        with patched_environ(store_env):
            return read_result(submission_id, remote_run_url=remote, logs=lambda: self.hook.logs(submission_id))

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None, lost: int = 0) -> Any:
        """Read the job's result: its value on success, a fail-at-once error for a user mistake.

        A job lost by a restarted Ray head is resubmitted as ``RayJobOperator`` does; the value is then the new job's.

        Raises:
            AirflowFailException: the job reported a mistake no retry can fix (its one-line message).
            AirflowException: the job failed otherwise, or succeeded without leaving a result.
        """
        if isinstance(event, Mapping) and event.get("status") == "lost" and lost < MAX_LOST_RESUBMITS:
            return super().execute_complete(context, event, lost)  # resubmits: execute, then this again
        spec = self._job_spec(context)
        submission_id = str(event.get("submission_id", "")) if isinstance(event, Mapping) else ""
        result = self._read_result(spec, submission_id) if submission_id else None
        failed = isinstance(event, Mapping) and event.get("status") != "success"
        if failed and result and result.get("status") == "error" and not result.get("retryable", True):
            raise AirflowFailException(f"{self.job}: {result.get('error')}")
        super().execute_complete(context, event, lost)  # raises for a failed, stopped or timed-out job
        if result is None or result.get("status") != "ok":
            raise AirflowException(f"Ray job {submission_id} succeeded but left no result ({result!r})")
        value = validate_result(self.job, result["value"])
        if self.on_result is not None:
            self.on_result(value, spec.request, context)
        return value
