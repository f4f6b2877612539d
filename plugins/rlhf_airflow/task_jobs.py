"""A pipeline task that loads a tokenizer or a model, or reads the run's folders, run as a Ray job: the Airflow side
stays torch-free and shares no disk with the cluster.

``RayTaskJobOperator`` is ``RayJobOperator`` (same hook, idempotent submission id per task instance, deferrable
trigger, re-attach on retry) with a typed request and a result::

    execute:           the job's request model builds the request from the task's values and the form
                       (JobRequest.from_task; a custom build_request may replace it) -> JobSpec;
                       submit  python -m rlhf_ops.cli pipeline-job <job>, the request as JSON in $RLHF_JOB_REQUEST;
                       defer to RayJobTrigger
    execute_complete:  read the job's result (rlhf_ops.pipeline.job_results: the run's remote store, else the job's
                       tagged last log line through the Jobs API); on_result(value, request, context) (the DAG
                       factory's: the request's event_extra on the job's Asset event); return the value (the XCom)

So a heavy task is its job module (``rlhf_ops.pipeline.heavy``: request, result, body) and one operator in the DAG.

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
    """The typed request (its model is the job's entry in ``rlhf_ops.pipeline.job_requests.PIPELINE_JOBS``)."""
    num_gpus: float | None = None
    """GPUs reserved for the job's driver (the model runs in it); None: none."""


def params_of(context: Mapping[str, Any]) -> Any:
    """The run's trigger form (``PipelineParams``); invalid values fail the task at once."""
    from rlhf_ops.pipeline.params import parse_params

    try:
        return parse_params(context["params"])
    except ValueError as exc:
        raise AirflowFailException(f"invalid pipeline parameters: {exc}") from None


def run_ref(params: Any, context: Mapping[str, Any]) -> Any:
    """Which run a job works for (``RunRef``): the job resolves its folders on the Ray side."""
    from rlhf_ops.pipeline.job_requests import RunRef

    return RunRef(
        dag_id=context["dag"].dag_id,
        run_id=context["run_id"],
        work_dir=params.work_dir,
        remote_store_url=params.remote_store_url,
    )


RequestBuilder = Callable[[Mapping[str, Any], "Context"], JobSpec]
ResultHandler = Callable[[dict[str, Any], Any, "Context"], None]


class RayTaskJobOperator(RayJobOperator):
    """Run the pipeline's heavy job ``job`` (an entry of ``rlhf_ops.pipeline.job_requests.PIPELINE_JOBS``) on Ray.

    Args:
        job: The job: a built-in's name, an entry point's, or a dotted path to a user's job body.
        request: The values the request is built from (templated: XComArgs resolve to their values at run time).
        build_request: Turns the rendered ``request`` and the context into the job's :class:`JobSpec`; None: the
            job's request model does (``from_task`` with the run's form and ids; a ``JobSkipped`` skips the task).
            Called in ``execute`` and again in ``execute_complete`` (deterministic). An ``AirflowSkipException``
            (nothing to do for this run) means nothing is submitted.
        on_result: Called with the job's result value, the request model and the context before it is returned
            (the DAG factory's puts the request's ``event_extra`` on the job's Asset event).
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
        build_request: RequestBuilder | None = None,
        request: dict[str, Any] | None = None,
        on_result: ResultHandler | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(entrypoint=job_entrypoint(job), **kwargs)
        self.job = job
        self.request = request
        self.build_request = build_request
        self.on_result = on_result

    def request_for(self, values: Mapping[str, Any], context: Context) -> JobSpec:
        """The job's :class:`JobSpec` for the rendered ``values`` (``build_request``, or the request model's
        ``from_task``)."""
        build = self.build_request or self._request_from_task
        return build(values, context)

    def _job_spec(self, context: Context) -> JobSpec:
        spec = self.request_for(dict(self.request or {}), context)
        wanted = job_entry(self.job).request
        if not isinstance(spec.request, wanted):
            raise TypeError(
                f"{self.task_id}: build_request gave a {type(spec.request).__name__}, not a {wanted.__name__}"
            )
        return spec

    def _request_from_task(self, values: Mapping[str, Any], context: Context) -> JobSpec:
        """The job's request model built from the task's values, the run's form and its ids."""
        from rlhf_airflow.compat import AirflowSkipException
        from rlhf_ops.pipeline.job_requests import JobSkipped

        params = params_of(context)
        try:
            request = job_entry(self.job).request.from_task(values, params=params, run=run_ref(params, context))
        except JobSkipped as exc:
            raise AirflowSkipException(str(exc)) from None
        return JobSpec(request=request, num_gpus=request.num_gpus())

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
