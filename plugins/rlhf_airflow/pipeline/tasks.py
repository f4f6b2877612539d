"""Task bodies of the RLHF pipeline: thin wrappers that call ``rlhf_ops.pipeline`` with values from the context.

The tasks that load a tokenizer or a model, or write one into the work folder (``prepare_data``,
``fetch_champion``, ``evaluate_checkpoint``, ``register_model``) are Ray jobs
(``rlhf_airflow.task_jobs.RayTaskJobOperator``); here are only their requests (``*_request``) and what is done
with their results on the Airflow side (``*_done``: Asset event extras). Every task in an Airflow process stays
torch-free and writes nothing into the work folder.

Every import of the platform library happens inside a function, at run time: parsing a DAG file never
imports torch, transformers or MLflow. Credentials come from Airflow connections (``job_env_from_connections``)
and live in the environment only while the task runs; they never reach XCom, params or logs.

User mistakes that a retry cannot fix (an invalid config value, rejected data) raise ``AirflowFailException``
so the task fails at once instead of retrying; everything else (network, storage) keeps Airflow's retries.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from airflow.sdk import PokeReturnValue

from rlhf_airflow.compat import (
    AirflowException,
    AirflowFailException,
    AirflowNotFoundException,
    AirflowSkipException,
)
from rlhf_airflow.pipeline.assets import set_event_extra

log = logging.getLogger(__name__)

HEADLINE_METRICS = ("eval/acc", "eval/reward/mean", "eval/mean_acc", "eval/pass_at_4", "eval/num_prompts")
FAILED_STATES = frozenset({"failed", "upstream_failed"})


def connection_env(*, s3_conn_id: str | None, mlflow_conn_id: str | None) -> dict[str, str]:
    """Environment from the S3 and MLflow connections; a connection that is not defined is skipped."""
    from rlhf_airflow.hooks import job_env_from_connections

    env: dict[str, str] = {}
    for kind, conn_id in (("s3_conn_id", s3_conn_id), ("mlflow_conn_id", mlflow_conn_id)):
        if not conn_id:
            continue
        try:
            env.update(job_env_from_connections(**{kind: conn_id}))
        except AirflowNotFoundException:
            log.info("connection %r is not defined; using this worker's environment instead", conn_id)
    return env


def _params(context: Mapping[str, Any]) -> Any:
    from rlhf_ops.pipeline.params import parse_params

    try:
        return parse_params(context["params"])
    except ValueError as exc:
        raise AirflowFailException(f"invalid pipeline parameters: {exc}") from None


def _layout(params: Any, context: Mapping[str, Any]) -> Any:
    from rlhf_ops.pipeline.layout import RunLayout

    try:
        return RunLayout.for_run(
            dag_id=context["dag"].dag_id,
            run_id=context["run_id"],
            work_dir=params.work_dir,
            remote_store_url=params.remote_store_url,
        )
    except ValueError as exc:
        raise AirflowFailException(str(exc)) from None


def prepare_data_request(request: Mapping[str, Any], context: Any) -> Any:
    """The ``prepare_data`` Ray job's request: the form's values, the run's layout, the DAG's override policy."""
    from rlhf_airflow.task_jobs import JobRequest

    params = _params(context)
    layout = _layout(params, context)
    body = {
        "params": params.model_dump(mode="json"),
        "layout": layout.to_dict(),
        "override_policy": dict(request.get("override_policy") or {}),
    }
    return JobRequest(request=body, result_dir=layout.jobs_dir)


def prepared_data_done(prepared: dict[str, Any], request: Mapping[str, Any], context: Any) -> None:
    """The ``prepared_data`` Asset event's extras, from the job's result."""
    keys = ("run_url", "train_url", "val_url", "num_train", "num_val", "num_rejected", "manifest_url")
    run_key = request["layout"]["run_key"]
    set_event_extra(context, "prepared_data", {k: prepared.get(k) for k in keys} | {"airflow_run_id": run_key})


def fetch_champion_request(request: Mapping[str, Any], context: Any) -> Any:
    """The ``fetch_champion`` Ray job's request; the task is skipped unless the run warm-starts from the champion."""
    from rlhf_airflow.task_jobs import JobRequest

    params = _params(context)
    if params.warm_start != "champion":
        raise AirflowSkipException(f"warm_start is {params.warm_start!r}: no champion to fetch")
    layout = _layout(params, context)
    body = {"registered_name": params.registered_name(layout.dag_id), "layout": layout.to_dict()}
    return JobRequest(request=body, result_dir=layout.jobs_dir)


def check_ray(*, ray_conn_id: str, address: str | None) -> str:
    """The Ray job server's URL after a version handshake with it (submits nothing)."""
    from rlhf_airflow.hooks import RayJobHook

    hook = RayJobHook(ray_conn_id, address=address or None)
    try:
        hook.get_conn()
    except AirflowNotFoundException:
        raise AirflowFailException(
            f"no Ray cluster: define the {ray_conn_id!r} connection or pass params.ray_address"
        ) from None
    except Exception as exc:  # connection refused, TLS, auth: retryable
        raise AirflowException(f"Ray job server {hook.dashboard_address} is unreachable: {exc}") from exc
    ok, problem = hook.test_connection()  # the cluster's Ray release (and token): what no retry can fix
    if not ok:
        raise AirflowFailException(problem)
    return hook.dashboard_address


def preflight(
    prepared: dict[str, Any],
    champion: dict[str, Any] | None,
    *,
    conns: Mapping[str, str | None],
    ray_conn_id: str,
    override_policy: Mapping[str, Any] | None = None,
    **context: Any,
) -> dict[str, Any]:
    """Resolve + validate the config, run pre-flight (the checks `rlhf train` runs), plan the checkpoints.

    ``champion`` is ``fetch_champion``'s result (None: skipped, the run starts from scratch); its model folder
    becomes ``model.path``. A bad value or a problem pre-flight finds fails the task at once (no retry can fix
    it), one log line each.
    """
    from rlhf_ops.config import ConfigError
    from rlhf_ops.pipeline.layout import patched_environ
    from rlhf_ops.pipeline.preflight import run_preflight

    params = _params(context)
    layout = _layout(params, context)
    model_path = (champion or {}).get("model_dir") if params.warm_start == "champion" else None
    with patched_environ(connection_env(**conns)):
        try:
            plan = run_preflight(params, layout, prepared, model_path=model_path, override_policy=override_policy)
        except ConfigError as exc:  # PreflightError too: the same lines `rlhf train` prints
            for problem in exc.problems:
                log.error("error: %s", problem)
            raise AirflowFailException(str(exc)) from None
    plan["ray_dashboard"] = check_ray(ray_conn_id=ray_conn_id, address=params.ray_address)
    return plan


def start_tracking(
    plan: dict[str, Any], prepared: dict[str, Any], *, conns: Mapping[str, str | None], **context: Any
) -> dict[str, str]:
    """Open (or find again, on a retry) the pipeline's MLflow run; pushes ``mlflow_run_id`` / ``mlflow_run_url``."""
    from rlhf_ops.pipeline.layout import patched_environ
    from rlhf_ops.pipeline.tracking import start_tracking as start

    params, ti = _params(context), context["ti"]
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
    step: int, layout: dict[str, Any], *, conns: Mapping[str, str | None], **context: Any
) -> PokeReturnValue:
    """Sensor poke: done once ``global_step_<step>`` is committed (locally or on the remote store)."""
    from rlhf_ops.pipeline.checkpoints import CheckpointNeverCommitted, checkpoint_ready
    from rlhf_ops.pipeline.layout import RunLayout, patched_environ

    train_state = _train_state(context)
    with patched_environ(connection_env(**conns)):
        try:
            found = checkpoint_ready(step, RunLayout.from_dict(layout), train_state=train_state)
        except CheckpointNeverCommitted as exc:
            if train_state in FAILED_STATES:
                raise AirflowSkipException(f"nothing to evaluate: {exc}") from None
            raise AirflowFailException(str(exc)) from None
    if found is None:
        log.info("global_step_%d is not committed yet (train: %s)", step, train_state)
        return PokeReturnValue(is_done=False)
    return PokeReturnValue(is_done=True, xcom_value={"step": step, "location": found})


def _gpus(config: Mapping[str, Any]) -> float | None:
    """One GPU for a job whose driver loads the model, when the run trains on CUDA."""
    return 1.0 if config["resources"]["device"] == "cuda" else None


def evaluate_request(request: Mapping[str, Any], context: Any) -> Any:
    """The ``evaluate`` Ray job's request: the found checkpoint, the run's config and layout, the form's settings."""
    from rlhf_airflow.task_jobs import JobRequest
    from rlhf_ops.pipeline.layout import RunLayout

    params = _params(context)
    found, config = request["found"], request["config"]
    body = {
        "step": int(found["step"]),
        "location": str(found["location"]),
        "config": config,
        "layout": request["layout"],
        "mlflow_run_id": request["mlflow_run_id"],
        "n_samples": params.eval_n_samples,
        "max_prompts": params.eval_max_prompts,
        "engine": params.eval_engine,
    }
    return JobRequest(request=body, result_dir=RunLayout.from_dict(request["layout"]).jobs_dir, num_gpus=_gpus(config))


def evaluation_done(result: dict[str, Any], request: Mapping[str, Any], context: Any) -> None:
    """The ``checkpoint`` Asset event's extras (step, location, headline metrics), from the job's result."""
    headline = {k: v for k, v in result["metrics"].items() if k in HEADLINE_METRICS}
    extra = {"step": result["step"], "checkpoint": request["location"], "metrics": headline}
    set_event_extra(context, "checkpoint", extra | {"mlflow_run_id": request["mlflow_run_id"]})


def sync_and_retain(layout: dict[str, Any], *, conns: Mapping[str, str | None], **context: Any) -> dict[str, Any]:
    """Final sync to the remote store, then keep the last ``keep_last`` checkpoints and the best."""
    from rlhf_ops.pipeline.layout import RunLayout, patched_environ
    from rlhf_ops.pipeline.retention import sync_and_retain as retain

    params = _params(context)
    with patched_environ(connection_env(**conns)):
        try:
            return retain(
                RunLayout.from_dict(layout),
                keep_last=params.keep_last,
                metric=params.eval_metric,
                promotion=params.promotion,
            )
        except ValueError as exc:  # eval_metric names no metric of the reports, promotion.metric none per prompt
            raise AirflowFailException(str(exc)) from None


def register_request(request: Mapping[str, Any], context: Any) -> Any:
    """The ``register`` Ray job's request: the run's layout and config, the form's metric and promotion test.

    ``request["move"]`` False (the approval gate is on): the job decides and logs, and the alias waits for
    ``promote_champion`` after the approval.
    """
    from rlhf_airflow.task_jobs import JobRequest
    from rlhf_ops.pipeline.layout import RunLayout

    params = _params(context)
    body = {
        "layout": request["layout"],
        "config": request["config"],
        "mlflow_run_id": request["mlflow_run_id"],
        "registered_name": request["registered_name"],
        "metric": params.eval_metric,
        "promotion": params.promotion.model_dump(mode="json"),
        "eval_n_samples": params.eval_n_samples,
        "eval_max_prompts": params.eval_max_prompts,
        "move": bool(request.get("move", True)),
        "engine": params.eval_engine,
    }
    layout = RunLayout.from_dict(request["layout"])
    return JobRequest(request=body, result_dir=layout.jobs_dir, num_gpus=_gpus(request["config"]))


def registration_done(result: dict[str, Any], request: Mapping[str, Any], context: Any) -> None:
    """The ``registered_model`` Asset event's extras, from the job's result."""
    keys = ("registered_name", "version", "model_uri", "best_step", "metric", "value", "summary")
    extra = {k: result.get(k) for k in keys} | {"mlflow_run_id": request["mlflow_run_id"]}
    set_event_extra(context, "registered_model", extra)


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
