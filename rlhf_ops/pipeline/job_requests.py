"""The pipeline's heavy jobs in one table, :data:`PIPELINE_JOBS`: name -> (request model, body, result model).

A heavy job is one module (the built-ins: :mod:`rlhf_ops.pipeline.heavy`): its request model (a :class:`JobRequest`
that builds itself from the trigger form's values, :meth:`JobRequest.from_task`), its result model, and its body,
declared with :func:`pipeline_job`. The Airflow task (``rlhf_airflow.task_jobs.RayTaskJobOperator``, wired in the DAG
factory) builds the request, sends it as JSON in the Ray job's ``$RLHF_JOB_REQUEST``; the job (``rlhf pipeline-job
<name>``, :mod:`rlhf_ops.pipeline.jobs`) parses it with the same model and calls the body. Both sides import the job
modules, so they stay torch-free: a body imports the heavy library when it runs.

A user's job is selected like any extension entry: by dotted path (``job="my_pkg.jobs:count_rows"``, through the
operator's allow-list of code modules) or by an entry point in the ``rlhf_ops.pipeline_jobs`` group.

Each request names its run (:class:`RunRef`), never a folder: the job resolves the run's folders on its own side
(``params.work_dir`` or the Ray node's ``$RLHF_WORK_DIR``), so the Airflow workers and the Ray cluster share no disk.

Requests carry ``schema_version``; a job reading a version it does not know fails in one line (the provider on the
Airflow side and the library on the Ray cluster are different installs).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from rlhf_ops.extensions.table import Entry, Table
from rlhf_ops.pipeline.layout import RunLayout, run_key

if TYPE_CHECKING:
    from rlhf_ops.pipeline.params import PipelineParams

SCHEMA_VERSION: Literal[1] = 1


class RunRef(BaseModel):
    """Which pipeline run a job works for; :meth:`layout` resolves its folders where the job runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dag_id: str
    run_id: str
    work_dir: str | None = None
    """``params.work_dir``: a folder on the Ray nodes; None: their ``$RLHF_WORK_DIR``."""
    remote_store_url: str | None = None

    @property
    def remote_run_url(self) -> str | None:
        """The run's folder on the remote store (the same on both sides), or None without one."""
        if not self.remote_store_url:
            return None
        return f"{self.remote_store_url.rstrip('/')}/{self.dag_id}/{run_key(self.run_id)}"

    def layout(self) -> RunLayout:
        """The run's folders on this machine (the Ray side)."""
        return RunLayout.for_run(
            dag_id=self.dag_id, run_id=self.run_id, work_dir=self.work_dir, remote_store_url=self.remote_store_url
        )


class JobSkipped(Exception):  # noqa: N818 - it names what happened, like Airflow's AirflowSkipException
    """Raised by :meth:`JobRequest.from_task`: this run has nothing for the job to do (the task is skipped)."""


class JobRequest(BaseModel):
    """Fields every heavy job's request has, and what the Airflow task asks of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    run: RunRef

    @classmethod
    def from_task(cls, values: Mapping[str, Any], *, params: PipelineParams, run: RunRef) -> Self:
        """The request of one task run (Airflow side, no heavy import).

        Args:
            values: The task's rendered ``request`` mapping (upstream results, the DAG's own values).
            params: The run's trigger form.
            run: The run.

        Raises:
            JobSkipped: nothing to do in this run.
        """
        raise NotImplementedError(f"{cls.__name__}.from_task: build the request from the task's values")

    def num_gpus(self) -> float | None:
        """GPUs reserved for the job's driver (None: none); a job that loads the model asks for one on CUDA."""
        return None

    def event_extra(self, result: Mapping[str, Any]) -> dict[str, Any] | None:
        """The extras of the Asset event the task emits (its job's ``asset``) from the job's result; None: none."""
        return None


def gpus_for(config: Mapping[str, Any]) -> float | None:
    """One GPU for a job whose driver loads the model, when the run trains on CUDA."""
    return 1.0 if config["resources"]["device"] == "cuda" else None


class JobResult(BaseModel):
    """A job's return value (the XCom downstream reads); subclasses name the keys the Airflow side uses."""

    model_config = ConfigDict(extra="allow")


R = TypeVar("R", bound=JobRequest)


@dataclass(frozen=True, kw_only=True)
class PipelineJob(Entry):
    """One heavy job (``RayTaskJobOperator(job=...)``, ``rlhf pipeline-job <name>``); ``target`` is its body,
    called with the validated request on the Ray side, returning the result value.

    Attributes:
        request: Its request model.
        result: Its result model (the task's XCom).
        asset: The pipeline Asset kind whose event carries :meth:`JobRequest.event_extra` (None: no event).
    """

    request: type[JobRequest]
    result: type[JobResult]
    asset: str | None = None

    def run(self, request: JobRequest) -> dict[str, Any]:
        """Call the body (on the Ray side)."""
        body: Callable[[Any], dict[str, Any]] = self.load()
        return body(request)


def _job_of(value: str, obj: Any) -> PipelineJob:
    """A job named by the dotted path of its body (decorated with :func:`pipeline_job`)."""
    entry = getattr(obj, "pipeline_job", None)
    if not isinstance(entry, PipelineJob):
        raise ValueError(f"job {value!r} names a function without @pipeline_job; declare it with rlhf_ops' decorator")
    return entry


PIPELINE_JOBS: Table[PipelineJob] = Table(
    what="pipeline job",
    key="job",
    entry_type=PipelineJob,
    group="rlhf_ops.pipeline_jobs",
    from_callable=_job_of,
    imported_in=("rlhf_ops.pipeline.heavy",),
)


def pipeline_job(
    name: str,
    *,
    request: type[R],
    result: type[JobResult],
    asset: str | None = None,
    description: str = "",
) -> Callable[[Callable[[R], dict[str, Any]]], Callable[[R], dict[str, Any]]]:
    """Declares the decorated function the body of heavy job ``name`` and registers it in :data:`PIPELINE_JOBS`.

    In a module of :mod:`rlhf_ops.pipeline.heavy` it is a built-in (the table imports every module there); a user's
    module registers it when imported (a dotted path to the function imports it).
    """

    def mark(fn: Callable[[R], dict[str, Any]]) -> Callable[[R], dict[str, Any]]:
        doc = description or (fn.__doc__ or "").strip().split("\n")[0]
        entry = PipelineJob(name=name, target=fn, description=doc, request=request, result=result, asset=asset)
        known = PIPELINE_JOBS.known(name)
        if known is not None and callable(known.target):
            same = (known.target.__module__, known.target.__qualname__) == (fn.__module__, fn.__qualname__)
            if not same:
                raise ValueError(f"pipeline job {name!r} is declared twice; give one of them another name")
            PIPELINE_JOBS.unregister(name)  # the same module imported again: its new objects replace the old
        PIPELINE_JOBS.register(entry)
        fn.pipeline_job = entry  # type: ignore[attr-defined]  # a dotted path to the body finds its entry
        return fn

    return mark


def job_entry(name: str) -> PipelineJob:
    """The table's entry for ``name``: a built-in's name, an entry point's, or a dotted path to a job's body.

    Raises:
        ValueError: ``name`` is not a pipeline job (one line with the fix).
    """
    return PIPELINE_JOBS.get(name)


def parse_request(name: str, raw: str | Mapping[str, Any]) -> JobRequest:
    """The request of job ``name`` from its JSON, version checked first.

    Raises:
        ValueError: one line: not JSON, a ``schema_version`` this library does not read, or a field that does not
            validate (named with its path).
    """
    entry = job_entry(name)
    try:
        data = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except ValueError as exc:
        raise ValueError(
            f"the {name} job's request is not JSON ({exc}); the pipeline sends it in $RLHF_JOB_REQUEST"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"the {name} job's request is a JSON {type(data).__name__}; it must be an object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"the {name} job's request has schema_version={version!r} but this rlhf-ops reads {SCHEMA_VERSION}: "
            "install the same rlhf-ops version on the Ray cluster as the Airflow provider was built with"
        )
    try:
        return entry.request.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        raise ValueError(f"the {name} job's request field {where!r}: {first['msg']}") from None


def validate_result(name: str, value: Mapping[str, Any]) -> dict[str, Any]:
    """``value`` checked against job ``name``'s result model, returned as a plain dict (the task's XCom)."""
    return job_entry(name).result.model_validate(dict(value)).model_dump(mode="json")
