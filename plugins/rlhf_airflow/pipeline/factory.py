"""Builds an RLHF pipeline DAG; ``dags/rlhf_ppo.py`` and ``dags/generated_pipelines.py`` call it.

::

    prepare_data ───┬→ preflight → start_tracking ─┬→ train (Ray job, deferrable) ─┬→ sync_and_retain → register_model
    fetch_champion ─┘                              └→ evaluate[i] (mapped group)   ┘  → promote_champion → end_tracking
                                                      wait_for_checkpoint → evaluate_checkpoint

``prepare_data``, ``fetch_champion`` (skipped unless ``warm_start`` is ``champion``), ``preflight``, ``train``,
each ``evaluate_checkpoint``, ``sync_and_retain`` and ``register_model`` are Ray jobs submitted by the same hook
and deferrable trigger (all but ``train`` through ``rlhf_airflow.task_jobs.RayTaskJobOperator``: a job module of
``rlhf_ops.pipeline.heavy`` builds each typed request and names its Asset, so a heavy task is its job module and its
line here). Nothing in an Airflow process loads torch, a tokenizer or a model, or reads or writes the cluster's work
folder, and every job ships the run's code (the spec's ``code``, and the form's
``code`` as far as ``allowed_code`` allows). ``train`` and each ``evaluate_checkpoint`` take slots
of the cluster pool (``rlhf_airflow.pools``); with a spec's ``approval`` on, ``approve_champion`` (human in the
loop) sits between ``register_model`` and ``promote_champion`` (``rlhf_airflow.pipeline.approval``).

``evaluate`` is a task group mapped over the global steps at which ``preflight`` says the trainer will commit
a checkpoint (``save_freq`` and the last step). Each map index waits for its checkpoint with a sensor in
reschedule mode (no worker slot held while waiting) and evaluates it as soon as it is committed, while
training goes on; each is its own task instance, visible, retried and clearable on its own. See
``docs/pipeline.md`` for why this mechanism and not assets or triggered DAG runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import pendulum
from airflow.sdk import DAG, task, task_group

from rlhf_airflow.operators import RayJobOperator
from rlhf_airflow.pipeline import tasks
from rlhf_airflow.pipeline.approval import ApprovalSpec, approval_spec, approval_task
from rlhf_airflow.pipeline.assets import pipeline_asset
from rlhf_airflow.pipeline.callbacks import on_task_failure
from rlhf_airflow.pipeline.params import pipeline_params
from rlhf_airflow.pools import ClusterPool, cluster_pool
from rlhf_airflow.task_jobs import RayTaskJobOperator

START_DATE = pendulum.datetime(2025, 1, 1, tz="UTC")
DEFAULT_ARGS = {"owner": "rlhf-platform", "retries": 2, "retry_delay": pendulum.duration(seconds=30)}
WEEK_S = 7 * 24 * 3600


def build_pipeline_dag(
    dag_id: str,
    *,
    schedule: Any = None,
    param_defaults: Mapping[str, Any] | None = None,
    tags: Sequence[str] = (),
    description: str | None = None,
    doc_md: str | None = None,
    ray_conn_id: str = "ray_default",
    mlflow_conn_id: str | None = "mlflow_default",
    s3_conn_id: str | None = "aws_default",
    api_conn_id: str | None = "airflow_api",
    checkpoint_poke_s: float = 20.0,
    checkpoint_timeout_s: float = WEEK_S,
    train_timeout_s: float | None = None,
    max_active_runs: int = 1,
    override_policy: Mapping[str, Any] | None = None,
    pool: ClusterPool | Mapping[str, Any] | None = None,
    approval: ApprovalSpec | Mapping[str, Any] | None = None,
) -> DAG:
    """One RLHF pipeline DAG.

    Args:
        dag_id: The DAG id (also the checkpoint experiment folder).
        schedule: Airflow schedule (None: triggered only; a cron string; a timetable).
        param_defaults: Default values of the trigger form's parameters (a YAML spec's ``params``).
        tags: Extra tags (``rlhf`` is always there).
        description: Short description shown in the UI.
        doc_md: Markdown shown on the DAG's page.
        ray_conn_id: Connection of the Ray job server (``params.ray_address`` overrides its URL).
        mlflow_conn_id: ``http`` connection of the MLflow server (None: ``$MLFLOW_TRACKING_URI``).
        s3_conn_id: ``aws`` connection with the remote store's credentials (None: the workers' environment).
        api_conn_id: ``http`` connection of Airflow's own REST API (URL, user, password) the failure callback writes
            the DAG run's note with (not defined, or None: no note; ``rlhf_airflow.pipeline.callbacks``).
        checkpoint_poke_s: Seconds between two checks for a new checkpoint.
        checkpoint_timeout_s: A checkpoint not committed within this time fails its evaluation.
        train_timeout_s: Seconds after which the Ray job is stopped and ``train`` fails (None: no limit).
        max_active_runs: Concurrent runs of this DAG (a spec's ``max_active_runs``).
        override_policy: Which keys the form's ``overrides`` may set beyond the default set, and the spec's own
            (trusted) overrides: ``{"extra_allowed", "trusted", "spec"}`` (``rlhf_ops.pipeline.override_policy``).
        pool: The Airflow pool of the cluster's capacity that ``train`` and each evaluation take slots of (a
            spec's ``pool`` mapping; None: ``rlhf_cluster``, see ``rlhf_airflow.pools``).
        approval: The optional human approval before the champion alias moves (a spec's ``approval`` mapping;
            None or ``enabled: false``: no gate, see ``rlhf_airflow.pipeline.approval``).
    """
    if not isinstance(max_active_runs, int) or isinstance(max_active_runs, bool) or max_active_runs < 1:
        raise ValueError(f"max_active_runs must be a positive integer, got {max_active_runs!r}")
    cluster = cluster_pool(pool)
    gate = approval_spec(approval)
    conns = {"s3_conn_id": s3_conn_id, "mlflow_conn_id": mlflow_conn_id}
    on_failure = partial(on_task_failure, mlflow_conn_id=mlflow_conn_id, api_conn_id=api_conn_id)
    policy = dict(override_policy or {})
    heavy = partial(heavy_task, dag_id=dag_id, ray_conn_id=ray_conn_id, conns=conns, code_policy=policy)
    with DAG(
        dag_id,
        schedule=schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=max_active_runs,
        params=pipeline_params(param_defaults),
        default_args={**DEFAULT_ARGS, "on_failure_callback": on_failure},
        tags=sorted({"rlhf", *tags}),
        description=description or "RLHF pipeline: prepare data, train on Ray, evaluate each checkpoint, register",
        doc_md=doc_md or __doc__,
    ) as dag:
        # XCom references are typed Any: a task called with XComArgs (resolved at run time) does not type-check
        # against the function's parameters, and Airflow types a multiple_outputs result as unindexable.
        prepared: Any = heavy(
            "prepare_data",
            job="prepare_data",
            request={"override_policy": policy},
        ).output
        # Skipped unless params.warm_start is "champion"; preflight puts its model folder into the config.
        champion: Any = heavy("fetch_champion", job="fetch_champion").output
        plan: Any = heavy(
            "preflight",
            job="preflight",
            request={"prepared": prepared, "champion": champion, "override_policy": policy},
            multiple_outputs=True,
            trigger_rule="none_failed",
        ).output
        tracking: Any = task(task_id="start_tracking", multiple_outputs=True)(tasks.start_tracking)(
            plan, prepared, conns=conns
        )
        train = _train(
            ray_conn_id=ray_conn_id, conns=conns, timeout_s=train_timeout_s, pool=cluster, code_policy=policy
        )
        tracking >> train
        evaluations = _evaluations(
            plan,
            tracking,
            conns=conns,
            evaluate=partial(
                heavy,
                "evaluate_checkpoint",
                pool=cluster.name,
                pool_slots=cluster.eval_slots,
            ),
            poke_s=checkpoint_poke_s,
            timeout_s=checkpoint_timeout_s,
        )
        retained = heavy("sync_and_retain", job="retain", trigger_rule="none_failed")
        [train, evaluations] >> retained
        registered: Any = heavy(
            "register_model",
            job="register",
            request={
                "config": plan["config"],
                "mlflow_run_id": tracking["mlflow_run_id"],
                "registered_name": plan["registered_model_name"],
                "move": not gate.enabled,  # with the gate, promote_champion moves it after the approval
            },
        ).output
        retained >> registered
        champion = task(task_id="promote_champion", outlets=[pipeline_asset(dag_id, "champion")])(
            tasks.promote_champion
        )(registered, tracking["mlflow_run_id"], conns=conns)
        if gate.enabled:
            registered >> approval_task(gate) >> champion
        ended = task(task_id="end_tracking")(tasks.end_tracking)(tracking["mlflow_run_id"], conns=conns)
        champion >> ended.as_teardown(setups=tracking.operator)
    dag.rlhf_cluster_pool = cluster  # type: ignore[attr-defined]  # read by rlhf_airflow.pools.pools_of (the tests' and the demo's set-up)
    return dag


def _train(
    *,
    ray_conn_id: str,
    conns: dict[str, str | None],
    timeout_s: float | None,
    pool: ClusterPool,
    code_policy: dict[str, Any],
) -> RayJobOperator:
    """The training Ray job: entrypoint from ``preflight``, the MLflow run id from ``start_tracking``."""
    return RayJobOperator(
        task_id="train",
        pool=pool.name,
        pool_slots=pool.train_slots,
        entrypoint="{{ ti.xcom_pull(task_ids='preflight', key='entrypoint') }}",
        ray_conn_id=ray_conn_id,
        ray_address="{{ params.ray_address or '' }}",
        env_vars={"MLFLOW_RUN_ID": "{{ ti.xcom_pull(task_ids='start_tracking', key='mlflow_run_id') }}"},
        s3_conn_id=conns["s3_conn_id"],
        mlflow_conn_id=conns["mlflow_conn_id"],
        code_policy=code_policy,
        deferrable=True,
        poll_interval=5,
        job_timeout=timeout_s,
        on_execute_callback=tasks.push_checkpoint_url,
    )


def heavy_task(
    task_id: str,
    *,
    job: str,
    dag_id: str,
    ray_conn_id: str = "ray_default",
    conns: Mapping[str, str | None] | None = None,
    **kwargs: Any,
) -> RayTaskJobOperator:
    """A task that loads a tokenizer or a model, as a Ray job on the cluster (``rlhf_airflow.task_jobs``).

    ``job`` is an entry of ``rlhf_ops.pipeline.job_requests.PIPELINE_JOBS`` (a built-in's name, or a dotted path to a
    user's job); its request model builds the request. A job with an Asset makes it the task's outlet, and its
    request's ``event_extra`` goes on the event.
    """
    from rlhf_ops.pipeline.job_requests import job_entry

    asset = job_entry(job).asset
    if asset is not None:
        kwargs.setdefault("outlets", [pipeline_asset(dag_id, asset)])
        kwargs.setdefault("on_result", partial(tasks.job_event, asset))
    conns = conns or {}
    return RayTaskJobOperator(
        task_id=task_id,
        job=job,
        ray_conn_id=ray_conn_id,
        ray_address="{{ params.ray_address or '' }}",
        s3_conn_id=conns.get("s3_conn_id"),
        mlflow_conn_id=conns.get("mlflow_conn_id"),
        deferrable=True,
        poll_interval=2,
        **kwargs,
    )


def _evaluations(
    plan: Any,
    tracking: Any,
    *,
    conns: dict[str, str | None],
    evaluate: Any,
    poke_s: float,
    timeout_s: float,
) -> Any:
    """The ``evaluate`` group (wait for checkpoint N, evaluate it) mapped over the planned checkpoint steps."""
    wait = task.sensor(task_id="wait_for_checkpoint", mode="reschedule", poke_interval=poke_s, timeout=timeout_s)(
        tasks.wait_for_checkpoint
    )

    @task_group(group_id="evaluate")
    def evaluate_group(step: int) -> None:
        # an XComArg (see build_pipeline_dag); the plan's steps let the first evaluation after an early stop take
        # the stopping step's checkpoint
        found: Any = wait(step=step, layout=plan["layout"], planned=plan["checkpoint_steps"], conns=conns)
        evaluate(
            job="evaluate",
            request={"found": found, "config": plan["config"], "mlflow_run_id": tracking["mlflow_run_id"]},
            max_active_tis_per_dagrun=1,
        )

    steps = task(task_id="plan_evaluations")(tasks.plan_evaluations)(plan["checkpoint_steps"])
    return evaluate_group.expand(step=steps)
