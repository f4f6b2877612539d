"""Task bodies of the RLHF pipeline: thin wrappers that call ``rlhf_ops.pipeline`` with values from the context.

The tasks that load a tokenizer or a model, or read or write the run's folders (``prepare_data``,
``fetch_champion``, ``preflight``, ``evaluate_checkpoint``, ``sync_and_retain``, ``register_model``) are Ray jobs
(``rlhf_airflow.task_jobs.RayTaskJobOperator``): each job's module in ``rlhf_ops.pipeline.heavy`` builds its request
and its Asset event's extras, so of them only :func:`job_event` is here, which puts those extras on the event. Every
task in an Airflow process stays torch-free and shares no folder with the cluster.

Every import of the platform library happens inside a function, at run time: parsing a DAG file never
imports torch, transformers or MLflow. This worker's own credentials come from Airflow connections
(``worker_env_from_connections``) and live in the environment only while the task runs; they never reach XCom,
params, logs or a Ray job.

User mistakes that a retry cannot fix (an invalid config value, rejected data) raise ``AirflowFailException``
so the task fails at once instead of retrying; everything else (network, storage) keeps Airflow's retries.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from airflow.sdk import PokeReturnValue

from rlhf_airflow.compat import (
    AirflowFailException,
    AirflowNotFoundException,
    AirflowSkipException,
)
from rlhf_airflow.pipeline.assets import set_event_extra
from rlhf_airflow.task_jobs import params_of

log = logging.getLogger(__name__)

FAILED_STATES = frozenset({"failed", "upstream_failed"})


def connection_env(*, s3_conn_id: str | None, mlflow_conn_id: str | None) -> dict[str, str]:
    """This worker's own S3 and MLflow access for one task; a connection that is not defined is skipped."""
    from rlhf_airflow.hooks import worker_env_from_connections

    env: dict[str, str] = {}
    for kind, conn_id in (("s3_conn_id", s3_conn_id), ("mlflow_conn_id", mlflow_conn_id)):
        if not conn_id:
            continue
        try:
            env.update(worker_env_from_connections(**{kind: conn_id}))
        except AirflowNotFoundException:
            log.info("connection %r is not defined; using this worker's environment instead", conn_id)
    return env


def job_event(asset: str, value: dict[str, Any], request: Any, context: Any) -> None:
    """A heavy task's ``on_result`` (bound to its job's Asset by the factory): the request's ``event_extra``."""
    extra = request.event_extra(value)
    if extra is not None:
        set_event_extra(context, asset, extra)


def start_tracking(
    plan: dict[str, Any], prepared: dict[str, Any], *, conns: Mapping[str, str | None], **context: Any
) -> dict[str, str]:
    """Open (or find again, on a retry) the pipeline's MLflow run; pushes ``mlflow_run_id`` / ``mlflow_run_url``."""
    from rlhf_ops.pipeline.layout import patched_environ
    from rlhf_ops.pipeline.tracking import start_tracking as start

    params, ti = params_of(context), context["ti"]
    with patched_environ(connection_env(**conns)):
        return start(
            config=plan["config"],
            preset=params.preset,
            dag_id=ti.dag_id,
            dag_run_id=ti.run_id,
            try_number=int(ti.try_number),
            run_date=context["dag_run"].run_after,
            prepared=prepared,
            extra_tags={
                "rlhf.checkpoint_url": plan["checkpoint_url"],
                "rlhf.registered_model": plan["registered_model_name"],
            },
        )


def plan_evaluations(checkpoint_steps: list[int]) -> list[int]:
    """The global steps to evaluate, one mapped ``evaluate`` group per step (Airflow maps only return values)."""
    return [int(step) for step in checkpoint_steps]


def push_checkpoint_url(context: Mapping[str, Any]) -> None:
    """``on_execute_callback`` of ``train``: publish the run's checkpoint folder for the Checkpoints link."""
    ti = context["ti"]
    url = ti.xcom_pull(task_ids="preflight", key="checkpoint_url")
    if url:
        ti.xcom_push(key="checkpoint_url", value=url)


def _train_state(context: Mapping[str, Any]) -> str | None:
    ti = context["ti"]
    states = ti.get_task_states(dag_id=ti.dag_id, task_ids=["train"], run_ids=[ti.run_id])
    state = (states.get(ti.run_id) or {}).get("train")
    return None if state is None else str(state)


def wait_for_checkpoint(
    step: int,
    layout: dict[str, Any],
    *,
    conns: Mapping[str, str | None],
    planned: list[int] | None = None,
    **context: Any,
) -> PokeReturnValue:
    """Sensor poke: done once ``global_step_<step>`` is committed on the remote store (without one: in the work
    folder, which then must be shared). After an early stop at a step the plan (``planned``) did not hold, the first
    planned evaluation after it takes the stopping step's checkpoint (``awaited_checkpoint``)."""
    from rlhf_ops.pipeline.checkpoints import CheckpointNeverCommitted, CheckpointNotTrained, awaited_checkpoint
    from rlhf_ops.pipeline.layout import RunLayout, patched_environ

    train_state = _train_state(context)
    run_layout = RunLayout.from_dict(layout)  # the cluster's paths: only its remote store is read from here
    with patched_environ(connection_env(**conns)):
        try:
            found = awaited_checkpoint(
                step,
                run_layout,
                planned=[int(p) for p in planned or [step]],
                train_state=train_state,
                local=not run_layout.remote_run_url,
            )
        except CheckpointNeverCommitted as exc:
            if train_state in FAILED_STATES or isinstance(exc, CheckpointNotTrained):  # early stop: a success
                raise AirflowSkipException(f"nothing to evaluate: {exc}") from None
            raise AirflowFailException(str(exc)) from None
    if found is None:
        log.info("global_step_%d is not committed yet (train: %s)", step, train_state)
        return PokeReturnValue(is_done=False)
    evaluated, where = found
    return PokeReturnValue(is_done=True, xcom_value={"step": evaluated, "location": where})


def promote_champion(
    registered: dict[str, Any], mlflow_run_id: str, *, conns: Mapping[str, str | None], **context: Any
) -> dict[str, Any]:
    """Emit the ``champion`` Asset event when the alias moved to this run's version; skipped when it stays."""
    from rlhf_ops.pipeline.champion import move_champion
    from rlhf_ops.pipeline.layout import patched_environ

    if not registered.get("promote"):
        raise AirflowSkipException(f"champion kept: {registered.get('summary')}")
    if not registered.get("promoted"):  # decided but not moved (register_model called with move=False)
        with patched_environ(connection_env(**conns)):
            move_champion(registered, run_id=mlflow_run_id)
    keys = ("registered_name", "version", "model_uri", "best_step", "metric", "value", "champion_version", "summary")
    champion = {k: registered.get(k) for k in keys}
    set_event_extra(
        context, "champion", champion | {"mlflow_run_id": mlflow_run_id, "previous": champion["champion_version"]}
    )
    return champion


def end_tracking(mlflow_run_id: str, *, conns: Mapping[str, str | None], **context: Any) -> str:
    """Teardown: close the MLflow run FINISHED, or FAILED when a task of this run failed; tag the Ray job."""
    from rlhf_ops.pipeline.layout import patched_environ
    from rlhf_ops.pipeline.tracking import end_tracking as end

    ti = context["ti"]
    states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id) or {}
    failed = any(str(state) in FAILED_STATES for task_id, state in states.items() if task_id != ti.task_id)
    tags = {}
    if submission_id := ti.xcom_pull(task_ids="train", key="ray_submission_id"):
        tags["ray.submission_id"] = str(submission_id)
    with patched_environ(connection_env(**conns)):
        return end(run_id=mlflow_run_id, failed=failed, tags=tags)
