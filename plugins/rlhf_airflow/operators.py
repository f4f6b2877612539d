"""Deferrable operator that runs one Ray job per task instance, re-attaching to it on retries.

``execute`` builds the job env (connections + ``env_vars`` + ``RLHF_SUBMISSION_ID``), submits idempotently
through ``RayJobHook.submit`` under a submission id derived from (dag_id, run_id, task_id, map_index), pushes
XComs ``ray_submission_id`` and ``ray_dashboard_url``, then defers to ``RayJobTrigger`` (or polls in the worker
when ``deferrable=False``). ``execute_complete`` turns the trigger event into a return value or an
``AirflowException`` carrying the job status and the last log lines, except for a job that ended preempted (exit
code 75: it checkpointed on a preemption notice), which is resubmitted with resume within the same try, and for a
job the Ray head lost (the head restarted without its job history while the task waited): it is resubmitted under
the same submission id with resume, at most ``MAX_LOST_RESUBMITS`` times per try. A head that comes back with the
job is simply re-attached to by the watcher (``RayJobWatcher``: polls are retried for ``head_outage_s``).

Killing: ``on_kill`` (worker side: SIGTERM while executing / polling) and ``RayJobTrigger.on_kill``
(triggerer side: the user marks a deferred task failed/success or clears it) both stop the Ray job.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from requests import RequestException

from rlhf_airflow.compat import AirflowException, AirflowFailException
from rlhf_airflow.hooks import RayJobHook, job_env_from_connections
from rlhf_airflow.links import (
    XCOM_DASHBOARD_URL,
    XCOM_SUBMISSION_ID,
    CheckpointFolderLink,
    MlflowRunLink,
    RayJobLink,
)
from rlhf_airflow.triggers import DEFAULT_HEAD_OUTAGE_S, RayJobTrigger, RayJobWatcher

if TYPE_CHECKING:
    from airflow.sdk import Context

SUBMISSION_ENV_VAR = "RLHF_SUBMISSION_ID"
MAX_SUBMISSION_ID_LEN = 100
_SUBMISSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
# Ray's message for a driver that exited with rlhf_ops.trainer.faults.EXIT_PREEMPTED (literal: no library import).
_PREEMPTED = re.compile(r"failed with exit code 75\b")
MAX_LOST_RESUBMITS = 3  # a job lost by a restarted Ray head is resubmitted at most this often within one try


def derive_submission_id(*, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """Deterministic Ray submission id for one task instance, identical for every try.

    The readable part keeps only ``[A-Za-z0-9_-]`` (Ray uses the id in URLs and log file names); a
    sha256 digest of the raw identity keeps ids distinct when sanitising or truncating merges them.
    Example: ``("rlhf", "manual__2025-01-01T00:00:00+00:00", "train")`` →
    ``"af-rlhf-manual__2025-01-01T00-00-00-00-00-train-<10 hex>"``.
    """
    parts = [dag_id, run_id, task_id] + ([str(map_index)] if map_index >= 0 else [])
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:10]
    body = "-".join(p for p in (_UNSAFE.sub("-", part).strip("-") for part in parts) if p)
    body = body[: MAX_SUBMISSION_ID_LEN - len("af--") - len(digest)].rstrip("-")
    return f"af-{body}-{digest}"


class RayJobOperator(BaseOperator):
    """Run ``entrypoint`` as a Ray job and wait for it (deferred by default).

    Args:
        entrypoint: Shell command for the job driver (templated).
        ray_conn_id: Airflow connection of type ``ray`` (dashboard URL, token, headers, verify).
        ray_address: Optional dashboard URL overriding the connection, e.g. ``"{{ params.ray_address }}"``
            (templated; empty means "use the connection").
        submission_id: Explicit Ray submission id; default derived from dag_id/run_id/task_id/map_index, so
            every retry of the task instance finds the same job.
        runtime_env: Ray runtime env (templated).
        env_vars: Extra env vars for the driver (templated); merged over the connection-derived ones.
        s3_conn_id: ``aws`` connection whose endpoint and region go into the job env (its credentials only with
            ``forward_credentials``, and then only short-lived ones: ``rlhf_airflow.hooks.job_env_from_connections``).
        mlflow_conn_id: ``http`` connection of the MLflow tracking server: its URL goes into the job env, never its
            user, password or token (the job uses the cluster's own MLflow credentials).
        forward_credentials: Forward short-lived S3 credentials (STS) to the job; None: the ``aws`` connection's
            extra ``forward_credentials`` decides (default: nothing forwarded, the cluster's own identity).
        code_policy: The DAG's override policy (``rlhf_ops.pipeline.override_policy``): when given, the spec's
            code and what the form's ``code`` parameter may add ship with the job (``runtime_env``
            ``working_dir`` / ``py_modules`` / ``pip``).
        deferrable: Wait in the triggerer (True) or by polling in the worker (False).
        poll_interval: Seconds between status polls.
        wait_for_completion: False returns right after submission (the id is the return value).
        job_timeout: Seconds since the job's start after which it is stopped and the task fails.
        head_outage_s: Seconds the wait tolerates an unreachable (restarting) Ray head before the task fails.
        entrypoint_num_cpus: CPUs reserved for the driver.
        entrypoint_num_gpus: GPUs reserved for the driver.
        entrypoint_resources: Custom resources reserved for the driver.
        **kwargs: ``BaseOperator`` arguments (task_id, retries…).
    """

    template_fields: Sequence[str] = ("entrypoint", "env_vars", "ray_address", "runtime_env")
    template_fields_renderers = {"runtime_env": "json", "env_vars": "json"}
    operator_extra_links = (RayJobLink(), MlflowRunLink(), CheckpointFolderLink())
    ui_color = "#e3f2fd"

    def __init__(
        self,
        *,
        entrypoint: str,
        ray_conn_id: str = RayJobHook.default_conn_name,
        ray_address: str | None = None,
        submission_id: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        s3_conn_id: str | None = None,
        mlflow_conn_id: str | None = None,
        forward_credentials: bool | None = None,
        code_policy: Mapping[str, Any] | None = None,
        deferrable: bool = True,
        poll_interval: float = 5,
        wait_for_completion: bool = True,
        job_timeout: float | None = None,
        head_outage_s: float = DEFAULT_HEAD_OUTAGE_S,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.entrypoint = entrypoint
        self.ray_conn_id = ray_conn_id
        self.ray_address = ray_address
        self.submission_id = submission_id
        self.runtime_env = runtime_env
        self.env_vars = env_vars
        self.s3_conn_id = s3_conn_id
        self.mlflow_conn_id = mlflow_conn_id
        self.forward_credentials = forward_credentials
        self.code_policy = None if code_policy is None else dict(code_policy)
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.wait_for_completion = wait_for_completion
        self.job_timeout = job_timeout
        self.head_outage_s = head_outage_s
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_num_gpus = entrypoint_num_gpus
        self.entrypoint_resources = entrypoint_resources
        self._active_submission_id: str | None = None
        self._hook: RayJobHook | None = None

    @property
    def hook(self) -> RayJobHook:
        """Hook for this task's Ray cluster (``ray_address`` wins over the connection when non-empty)."""
        if self._hook is None:
            self._hook = RayJobHook(self.ray_conn_id, address=self.ray_address or None)
        return self._hook

    def resolve_submission_id(self, context: Context | Mapping[str, Any]) -> str:
        """The explicit ``submission_id`` (validated) or the one derived from the task instance in ``context``.

        Raises:
            ValueError: the explicit id has characters outside ``[A-Za-z0-9_-]`` or is longer than 128.
        """
        if self.submission_id:
            if not _SUBMISSION_ID_RE.match(self.submission_id):
                raise ValueError(
                    f"submission_id={self.submission_id!r} must match {_SUBMISSION_ID_RE.pattern}; "
                    "leave it unset to derive one from dag_id/run_id/task_id"
                )
            return self.submission_id
        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        return derive_submission_id(
            dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=-1 if map_index is None else map_index
        )

    def submit_job(self, context: Context | Mapping[str, Any], *, resume: bool = False) -> str:
        """Build the env and submit (or re-attach to) the job; returns the submission id that owns it.

        ``resume``: a new job resumes from its newest checkpoint (``RLHF_RESUME_MODE=auto``), also under the base id.
        """
        base_id = self.resolve_submission_id(context)
        env = job_env_from_connections(
            s3_conn_id=self.s3_conn_id,
            mlflow_conn_id=self.mlflow_conn_id,
            forward_credentials=self.forward_credentials,
        )
        runtime_env, shipped = self.shipped_runtime_env(context)
        env.update(shipped)
        env.update(self.env_vars or {})
        env[SUBMISSION_ENV_VAR] = base_id  # stable across retries: the entrypoint keys its run folder on it
        ti = context.get("ti")
        metadata = {
            "airflow_dag_id": str(getattr(ti, "dag_id", "")),
            "airflow_run_id": str(getattr(ti, "run_id", "")),
            "airflow_task_id": str(getattr(ti, "task_id", self.task_id)),
            "airflow_try_number": str(getattr(ti, "try_number", "")),
        }
        try:
            self._active_submission_id = self.hook.submit(
                self.entrypoint,
                submission_id=base_id,
                runtime_env=runtime_env,
                env_vars=env,
                metadata=metadata,
                resume=resume,
                entrypoint_num_cpus=self.entrypoint_num_cpus,
                entrypoint_num_gpus=self.entrypoint_num_gpus,
                entrypoint_resources=self.entrypoint_resources,
            )
        except (OSError, RequestException) as exc:  # connection refused, DNS, TLS: nothing was submitted
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AirflowException(
                f"Ray job server {self.hook.dashboard_address} does not answer ({first}); check the host and port of "
                f"the {self.ray_conn_id!r} connection (or params.ray_address) and that the Ray head is up"
            ) from None
        return self._active_submission_id

    def shipped_runtime_env(
        self, context: Context | Mapping[str, Any]
    ) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """``runtime_env`` with the run's shipped code, and the env naming its modules (checked at job start).

        Raises:
            AirflowFailException: the form's ``code`` ships something the policy does not allow (one line).
        """
        if self.code_policy is None:
            return self.runtime_env, {}
        from rlhf_ops.pipeline.job_results import SHIPPED_MODULES_ENV
        from rlhf_ops.pipeline.override_policy import OverridePolicy

        params = context.get("params") or {}
        try:
            code = OverridePolicy.from_dict(self.code_policy).shipped_code(params.get("code"))
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None
        fields = code.runtime_env()
        if not fields:
            return self.runtime_env, {}
        names = code.module_names()
        return {**(self.runtime_env or {}), **fields}, ({SHIPPED_MODULES_ENV: ",".join(names)} if names else {})

    def execute(self, context: Context, *, resume: bool = False, lost: int = 0) -> str | None:
        """Submit or re-attach, publish the job's id and URL, then defer (or poll) until it ends.

        ``resume`` and ``lost`` (jobs lost by a restarted head so far in this try) are set by ``execute_complete``.
        """
        submission_id = self.submit_job(context, resume=resume)
        context["ti"].xcom_push(key=XCOM_SUBMISSION_ID, value=submission_id)
        context["ti"].xcom_push(key=XCOM_DASHBOARD_URL, value=self.hook.job_url(submission_id))
        self.log.info("Ray job %s: %s", submission_id, self.hook.job_url(submission_id))
        if not self.wait_for_completion:
            return submission_id
        if self.deferrable:
            self.defer(
                trigger=RayJobTrigger(
                    self.hook.dashboard_address,
                    submission_id,
                    poll_interval=self.poll_interval,
                    timeout=self.job_timeout,
                    ray_conn_id=self.ray_conn_id,
                    head_outage_s=self.head_outage_s,
                ),
                method_name="execute_complete",
                kwargs={"lost": lost} if lost else None,
            )
        return self.execute_complete(context, self._wait_in_worker(submission_id), lost=lost)

    def _wait_in_worker(self, submission_id: str) -> dict[str, Any]:
        watcher = RayJobWatcher(submission_id, timeout=self.job_timeout, head_outage_s=self.head_outage_s)
        while (event := watcher.step(self.hook.get_conn(), self.log.info)) is None:
            time.sleep(self.poll_interval)
        return event

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None, lost: int = 0) -> str:
        """Validate the trigger event: return the submission id on success, raise otherwise.

        A job the Ray head lost (``"lost"``: the head restarted without it) is resubmitted with resume under the
        same id, at most ``MAX_LOST_RESUBMITS`` times per try; ``lost`` counts them.

        Raises:
            AirflowException: the event is malformed, the job did not succeed, or it timed out (the job is
                stopped first); the message carries the Ray status, its message and the log tail.
        """
        if not isinstance(event, Mapping) or "status" not in event or "submission_id" not in event:
            raise AirflowException(f"RayJobTrigger sent a malformed event: {event!r}")
        submission_id = str(event["submission_id"])
        self._active_submission_id = submission_id
        if event["status"] == "success":
            self.log.info("Ray job %s succeeded", submission_id)
            return submission_id
        if event["status"] == "timeout":
            self._stop_quietly(submission_id)
        if event["status"] == "error" and _PREEMPTED.search(str(event.get("message", ""))):
            # Preempted with notice (rlhf_ops.trainer.faults.EXIT_PREEMPTED): it checkpointed, so it is resubmitted
            # at once with resume (the hook's next retry id) inside this try: a preemption is not a failure.
            self.log.warning("Ray job %s was preempted; resubmitting it to resume (not a failed try)", submission_id)
            return str(self.execute(context))
        if event["status"] == "lost" and lost < MAX_LOST_RESUBMITS:
            # The head restarted without the job (its driver died with it): nothing of it runs any more, so the same
            # id is free; the new job resumes from the last checkpoint. Not a failed try either.
            self.log.warning(
                "Ray job %s is gone from the Ray head (%s); resubmitting it to resume (%d of %d in this try)",
                submission_id,
                event.get("message", ""),
                lost + 1,
                MAX_LOST_RESUBMITS,
            )
            return self.execute(context, resume=True, lost=lost + 1)  # type: ignore[return-value]  # a subclass's value
        raise AirflowException(
            f"Ray job {submission_id} {event['status']}: status={event.get('job_status')} "
            f"message={event.get('message', '')!r}\n--- last log lines ---\n{event.get('log_tail', '')}"
        )

    def on_kill(self) -> None:
        """Stop the Ray job when the running task is killed (external kill, mark failed, timeout)."""
        if self._active_submission_id:
            self._stop_quietly(self._active_submission_id)

    def _stop_quietly(self, submission_id: str) -> None:
        try:
            stopped = self.hook.stop(submission_id)
            self.log.info("Stop requested for Ray job %s (was running: %s)", submission_id, stopped)
        except Exception:  # killing must not mask the original failure
            self.log.exception("Could not stop Ray job %s", submission_id)
