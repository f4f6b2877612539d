"""The pipeline's heavy jobs in one table: name -> (request model, runner, result model).

An Airflow task (``rlhf_airflow.pipeline.tasks``) builds a request model, ``RayTaskJobOperator`` sends it as JSON in
the Ray job's ``$RLHF_JOB_REQUEST``, and the job (``rlhf pipeline-job <name>``, :mod:`rlhf_ops.pipeline.jobs`) parses
it with the same model and calls the entry's runner (:mod:`rlhf_ops.pipeline.job_runners`, named by dotted path).
Both sides import this module, so it stays torch-free.

Each request names its run (:class:`RunRef`), never a folder: the job resolves the run's folders on its own side
(``params.work_dir`` or the Ray node's ``$RLHF_WORK_DIR``), so the Airflow workers and the Ray cluster share no disk.

Requests carry ``schema_version``; a job reading a version it does not know fails in one line (the provider on the
Airflow side and the library on the Ray cluster are different installs). A new heavy job is one request model and one
:data:`JOBS` entry here, its runner, and its task in the DAG factory.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlhf_ops.pipeline.layout import RunLayout, run_key

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


class JobRequest(BaseModel):
    """Fields every heavy job's request has."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    run: RunRef


class JobResult(BaseModel):
    """A job's return value (the XCom downstream reads); subclasses name the keys the Airflow side uses."""

    model_config = ConfigDict(extra="allow")


class PrepareDataRequest(JobRequest):
    params: dict[str, Any]
    """The trigger form's values (``PipelineParams`` as JSON)."""
    override_policy: dict[str, Any] = Field(default_factory=dict)


class PrepareDataResult(JobResult):
    train_url: str
    val_url: str
    num_train: int
    num_val: int
    num_rejected: int
    manifest_url: str
    manifest: dict[str, Any] = Field(default_factory=dict)
    """The data manifest itself, so ``start_tracking`` logs it without reading the job's folder."""
    rejected_sample: list[dict[str, Any]] = Field(default_factory=list)


class FetchChampionRequest(JobRequest):
    registered_name: str


class FetchChampionResult(JobResult):
    model_dir: str | None = None


class PreflightRequest(JobRequest):
    params: dict[str, Any]
    prepared: dict[str, Any]
    model_path: str | None = None
    """The champion's model folder for a warm start (``fetch_champion``'s result)."""
    override_policy: dict[str, Any] = Field(default_factory=dict)


class PreflightResult(JobResult):
    config: dict[str, Any]
    entrypoint: str
    checkpoint_steps: list[int]
    layout: dict[str, Any]
    checkpoint_url: str
    registered_model_name: str


class EvaluateRequest(JobRequest):
    step: int
    location: str
    config: dict[str, Any]
    mlflow_run_id: str | None = None
    n_samples: int
    max_prompts: int
    engine: str = "auto"


class EvaluateResult(JobResult):
    step: int
    metrics: dict[str, Any]


class RetainRequest(JobRequest):
    keep_last: int
    metric: str
    promotion: dict[str, Any] = Field(default_factory=dict)


class RetainResult(JobResult):
    best_step: int | None = None


class RegisterRequest(JobRequest):
    config: dict[str, Any]
    mlflow_run_id: str
    registered_name: str
    metric: str
    promotion: dict[str, Any] = Field(default_factory=dict)
    eval_n_samples: int
    eval_max_prompts: int
    move: bool = True
    engine: str = "auto"


class RegisterResult(JobResult):
    registered_name: str | None = None
    promote: bool | None = None


@dataclass(frozen=True)
class JobEntry:
    """One heavy job: what it reads, what it runs, what it returns."""

    request: type[JobRequest]
    runner: str
    """``module:function`` called with a validated ``request`` on the Ray side; returns the result value. A dotted
    path, so that importing the table (the Airflow side does) never imports the heavy library."""
    result: type[JobResult]

    def run(self, request: JobRequest) -> dict[str, Any]:
        """Import the runner and call it (on the Ray side)."""
        module, _, function = self.runner.partition(":")
        runner: Callable[[Any], dict[str, Any]] = getattr(importlib.import_module(module), function)
        return runner(request)


_RUNNERS = "rlhf_ops.pipeline.job_runners"
JOBS: dict[str, JobEntry] = {
    "prepare_data": JobEntry(PrepareDataRequest, f"{_RUNNERS}:prepare_data", PrepareDataResult),
    "fetch_champion": JobEntry(FetchChampionRequest, f"{_RUNNERS}:fetch_champion", FetchChampionResult),
    "preflight": JobEntry(PreflightRequest, f"{_RUNNERS}:preflight", PreflightResult),
    "evaluate": JobEntry(EvaluateRequest, f"{_RUNNERS}:evaluate", EvaluateResult),
    "retain": JobEntry(RetainRequest, f"{_RUNNERS}:retain", RetainResult),
    "register": JobEntry(RegisterRequest, f"{_RUNNERS}:register", RegisterResult),
}


def job_entry(name: str) -> JobEntry:
    """The table's entry for ``name``.

    Raises:
        ValueError: ``name`` is not a pipeline job.
    """
    if name not in JOBS:
        raise ValueError(f"job {name!r} is not a pipeline job; choose one of {sorted(JOBS)}")
    return JOBS[name]


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
