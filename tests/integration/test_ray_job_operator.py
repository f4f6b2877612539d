"""RayJobHook / RayJobTrigger / RayJobOperator against a real private Ray head (dashboard + job server).

The head runs with token auth (Ray 2.60's default for ``ray start``); the Airflow connection carries the token
as its password. Jobs are tiny ``python -c`` entrypoints; the module takes ~1 min on 2 shared cores.
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env, migrate_airflow_db

configure_airflow_env()  # before anything imports airflow

import asyncio  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from rlhf_airflow.hooks import RayJobHook  # noqa: E402
from rlhf_airflow.operators import RayJobOperator, derive_submission_id  # noqa: E402
from rlhf_airflow.triggers import RayJobTrigger  # noqa: E402
from rlhf_ops.pipeline.local_stack import start_ray_head  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
CONN_ID = "ray_it"


def _submission_ids(hook: RayJobHook) -> list[str]:
    """Submission ids of every job the cluster knows (what an idempotent submit must not multiply)."""
    return [j.submission_id for j in hook.get_conn().list_jobs() if j.submission_id]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Ray head; the ``ray_it`` connection points at it. Yields the dashboard URL."""
    token = secrets.token_hex(16)
    # The cluster's own work folder: the heavy jobs resolve it there; this (the Airflow) side never sees it.
    os.environ["RLHF_WORK_DIR"] = str(tmp_path_factory.mktemp("ray_work"))
    try:
        head = start_ray_head(tmp_path_factory.mktemp("ray_head"), auth_token=token, num_cpus=1)
    finally:
        os.environ.pop("RLHF_WORK_DIR")
    dashboard_url, stop = head.url, head.stop
    port = int(dashboard_url.rsplit(":", 1)[1])
    env_key = f"AIRFLOW_CONN_{CONN_ID.upper()}"
    os.environ[env_key] = json.dumps({"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": token})
    try:
        yield dashboard_url
    finally:
        os.environ.pop(env_key, None)
        stop()


def _trigger_for(hook: RayJobHook, submission_id: str) -> RayJobTrigger:
    # Only the connection id: the triggerer reads the token from it (the head refuses requests without it).
    return RayJobTrigger(hook.dashboard_address, submission_id, poll_interval=0.5, ray_conn_id=hook.ray_conn_id)


def _first_event(trigger: RayJobTrigger, timeout_s: float = 90) -> dict[str, Any]:
    async def run() -> Any:
        return await anext(trigger.run())

    return asyncio.run(asyncio.wait_for(run(), timeout=timeout_s)).payload


def _wait_status(hook: RayJobHook, submission_id: str, wanted: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := hook.status(submission_id)) != wanted:
        assert time.monotonic() < deadline, f"{submission_id} still {status}, wanted {wanted}"
        time.sleep(0.3)


def _unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def test_submit_reattaches_and_trigger_reports_success_with_log_tail(ray_head: str) -> None:
    hook = RayJobHook(CONN_ID)
    base = _unique("it-hello")
    entry = "python -c \"import os, time; print('hello', os.environ['GREETING_TARGET']); time.sleep(3)\""
    first = hook.submit(entry, submission_id=base, env_vars={"GREETING_TARGET": "world"})
    second = hook.submit(entry, submission_id=base, env_vars={"GREETING_TARGET": "world"})
    assert first == second == base
    assert hook.status(base) in ("PENDING", "RUNNING")  # the job sleeps 3 s, so the re-attach hit a live job
    assert [s for s in _submission_ids(hook) if s.startswith(base)] == [base]  # one job, not two

    event = _first_event(_trigger_for(hook, base))
    assert (event["status"], event["job_status"], event["submission_id"]) == ("success", "SUCCEEDED", base)
    assert "hello world" in event["log_tail"].splitlines()
    # After success a third submit returns the same id and still creates nothing.
    assert hook.submit(entry, submission_id=base) == base
    assert [s for s in _submission_ids(hook) if s.startswith(base)] == [base]


def test_failed_job_reports_stderr_then_retry_submits_with_resume_mode(ray_head: str) -> None:
    hook = RayJobHook(CONN_ID)
    base = _unique("it-fail")
    # Fails (exit 3, message on stderr) unless RLHF_RESUME_MODE is set, which only retries get.
    entry = (
        "python -c \"import os, sys; mode = os.environ.get('RLHF_RESUME_MODE'); "
        "print('resume=' + str(mode), file=sys.stderr); sys.exit(0 if mode else 3)\""
    )
    assert hook.submit(entry, submission_id=base) == base
    event = _first_event(_trigger_for(hook, base))
    assert (event["status"], event["job_status"]) == ("error", "FAILED")
    assert "resume=None" in event["log_tail"]
    assert "exit code 3" in event["message"]

    retry = hook.submit(entry, submission_id=base)
    assert retry == f"{base}-retry1"
    event = _first_event(_trigger_for(hook, retry))
    assert (event["status"], event["submission_id"]) == ("success", retry)
    assert "resume=auto" in event["log_tail"]
    assert sorted(s for s in _submission_ids(hook) if s.startswith(base)) == [base, retry]


def test_deferred_trigger_kwargs_hold_no_token_and_the_triggerer_reads_it_from_the_connection(ray_head: str) -> None:
    from airflow.sdk.exceptions import TaskDeferred
    from airflow.sdk.serde import deserialize, serialize

    token = json.loads(os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"])["password"]
    op = RayJobOperator(
        task_id="train", entrypoint="python -c \"print('deferred ok')\"", ray_conn_id=CONN_ID, poll_interval=0.5
    )
    ti = _TaskInstance(dag_id="it_secret", run_id=_unique("manual"), task_id="train")
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})  # type: ignore[arg-type]
    classpath, kwargs = deferred.value.trigger.serialize()
    stored = json.dumps(serialize(kwargs))  # what Airflow writes into its trigger table
    assert token not in stored and "Authorization" not in stored
    assert kwargs["ray_conn_id"] == CONN_ID
    # The triggerer re-creates the trigger from the stored kwargs; the head refuses requests without the token.
    revived = RayJobTrigger(**deserialize(json.loads(stored)))
    event = _first_event(revived)
    assert (event["status"], event["submission_id"]) == ("success", ti.xcoms["ray_submission_id"])
    assert "deferred ok" in event["log_tail"]


def test_operator_and_trigger_on_kill_stop_running_jobs(ray_head: str) -> None:
    sleeper = "python -c \"import time; print('sleeping', flush=True); time.sleep(120)\""
    op = RayJobOperator(task_id="sleepy", entrypoint=sleeper, ray_conn_id=CONN_ID, submission_id=_unique("it-kill-op"))
    by_op = op.submit_job({})
    hook = RayJobHook(CONN_ID)
    by_trigger = hook.submit(sleeper, submission_id=_unique("it-kill-trig"))
    _wait_status(hook, by_op, "RUNNING")
    _wait_status(hook, by_trigger, "RUNNING")

    op.on_kill()  # worker side: the task process got SIGTERM
    asyncio.run(_trigger_for(hook, by_trigger).on_kill())  # triggerer side: user marked the deferred task failed
    _wait_status(hook, by_op, "STOPPED", timeout_s=30)
    _wait_status(hook, by_trigger, "STOPPED", timeout_s=30)


def test_job_timeout_yields_timeout_and_execute_complete_stops_the_job(ray_head: str) -> None:
    from airflow.sdk.exceptions import AirflowException

    hook = RayJobHook(CONN_ID)
    submission_id = hook.submit(
        "python -c \"print('slow', flush=True); import time; time.sleep(120)\"", submission_id=_unique("it-slow")
    )
    _wait_status(hook, submission_id, "RUNNING")
    # Ray's start_time was set at submission (> 0.1 s ago): the first poll of a RUNNING job already times out.
    trigger = RayJobTrigger(hook.dashboard_address, submission_id, poll_interval=0.5, timeout=0.1, ray_conn_id=CONN_ID)
    event = _first_event(trigger)
    assert (event["status"], event["job_status"]) == ("timeout", "RUNNING")
    op = RayJobOperator(task_id="slow", entrypoint="unused", ray_conn_id=CONN_ID)
    with pytest.raises(AirflowException, match=f"Ray job {submission_id} timeout: status=RUNNING"):
        op.execute_complete({}, event)
    _wait_status(hook, submission_id, "STOPPED", timeout_s=30)


_DAG_FILE = """
import pendulum
from airflow.sdk import DAG, task

from rlhf_airflow.operators import RayJobOperator

with DAG("{dag_id}", schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False) as dag:

    @task
    def start_tracking(**context):
        context["ti"].xcom_push(key="mlflow_run_url", value="http://mlflow:5000/#/experiments/1/runs/abc")
        context["ti"].xcom_push(key="checkpoint_url", value="s3://ckpt/exp/run")

    train = RayJobOperator(
        task_id="train",
        entrypoint=(
            "python -c \\"import os; print('trained', os.environ['RUN_KEY'], "
            "os.environ['RLHF_SUBMISSION_ID'])\\""
        ),
        ray_conn_id="{conn_id}",
        env_vars={{"RUN_KEY": "{{{{ dag.dag_id }}}}"}},
        poll_interval=0.5,
    )
    start_tracking() >> train
"""


def _load_dag_file(dag_id: str) -> Any:
    """Write the DAG into the dags folder (Airflow 3.3's dag.test() needs it in a bundle) and import it."""
    import importlib.util

    path = configure_airflow_env() / "dags" / f"{dag_id}.py"
    path.write_text(_DAG_FILE.format(dag_id=dag_id, conn_id=CONN_ID))
    spec = importlib.util.spec_from_file_location(f"_it_dag_{dag_id}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def test_dag_test_defers_completes_and_publishes_links(ray_head: str, monkeypatch: pytest.MonkeyPatch) -> None:
    migrate_airflow_db()
    from airflow.sdk.types import TaskInstanceKey

    from rlhf_airflow.links import CheckpointFolderLink, MlflowRunLink, RayJobLink

    monkeypatch.setenv("AIRFLOW__RLHF__CHECKPOINT_TASK_ID", "start_tracking")
    monkeypatch.setenv("AIRFLOW__RLHF__S3_CONSOLE_URL_TEMPLATE", "http://minio:9001/browser/{bucket}/{key}")
    dag_id = _unique("it_ray_dag").replace("-", "_")
    dag = _load_dag_file(dag_id)
    train = dag.get_task("train")

    dag_run = dag.test()
    assert dag_run.state == "success"
    expected_id = derive_submission_id(dag_id=dag_id, run_id=dag_run.run_id, task_id="train")
    expected_url = f"{ray_head}/#/jobs/{expected_id}"
    hook = RayJobHook(CONN_ID)
    assert hook.status(expected_id) == "SUCCEEDED"
    assert f"trained {dag_id} {expected_id}" in hook.logs(expected_id)  # templated env + RLHF_SUBMISSION_ID

    xcoms = _xcoms(dag_id, dag_run.run_id, "train")
    assert xcoms["return_value"] == expected_id
    assert xcoms["ray_submission_id"] == expected_id and xcoms["ray_dashboard_url"] == expected_url
    # Rendered by the worker at finalize() and stored under link.xcom_key (what the UI shows without the plugin).
    assert xcoms["_link_RayJobLink"] == expected_url
    assert xcoms["_link_MlflowRunLink"] == "http://mlflow:5000/#/experiments/1/runs/abc"
    assert xcoms["_link_CheckpointFolderLink"] == "http://minio:9001/browser/ckpt/exp/run"

    # API-server path (no Task SDK comms here): the plugin's links read the metadata DB directly.
    key = TaskInstanceKey(dag_id=dag_id, task_id="train", run_id=dag_run.run_id, try_number=1, map_index=-1)
    assert RayJobLink().get_link(train, ti_key=key) == expected_url
    assert MlflowRunLink().get_link(train, ti_key=key) == "http://mlflow:5000/#/experiments/1/runs/abc"
    assert CheckpointFolderLink().get_link(train, ti_key=key) == "http://minio:9001/browser/ckpt/exp/run"


def _xcoms(dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.execute(
            XComModel.get_many(run_id=run_id, dag_ids=dag_id, task_ids=task_id).with_only_columns(
                XComModel.key, XComModel.value
            )
        ).all()
    return {key: _decode(value) for key, value in rows}


def _decode(value: Any) -> Any:
    # XCom rows hold JSON; values pushed through the Task SDK are JSON-encoded once more, link XComs are not.
    try:
        return json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return value


class _TaskInstance:
    """The task instance fields RayJobOperator reads, and the XComs it pushes (no metadata DB needed)."""

    def __init__(self, *, dag_id: str, run_id: str, task_id: str) -> None:
        self.dag_id, self.run_id, self.task_id, self.map_index, self.try_number = dag_id, run_id, task_id, -1, 1
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


def _prepare_job(
    tmp_path: Any, *, code_policy: dict[str, Any] | None = None, **params: Any
) -> tuple[Any, dict[str, Any]]:
    """A ``prepare_data`` heavy-task operator on ``params`` (polling in this process) and its task context.

    The request names the run only: the job resolves its folder on the cluster (the head's ``$RLHF_WORK_DIR``), and
    the run has no remote store, so the result comes back as the job's tagged log line.
    """
    from rlhf_airflow.task_jobs import JobSpec, RayTaskJobOperator
    from rlhf_ops.pipeline.heavy.prepare_data import PrepareDataRequest
    from rlhf_ops.pipeline.job_requests import RunRef
    from rlhf_ops.pipeline.params import PipelineParams

    run_id = _unique("manual")
    body = PrepareDataRequest(
        run=RunRef(dag_id="it_heavy", run_id=run_id), params=PipelineParams(**params).model_dump(mode="json")
    )
    op = RayTaskJobOperator(
        task_id="prepare_data",
        job="prepare_data",
        build_request=lambda request, context: JobSpec(request=body),
        ray_conn_id=CONN_ID,
        code_policy=code_policy,
        deferrable=False,
        poll_interval=0.5,
    )
    return op, {"ti": _TaskInstance(dag_id="it_heavy", run_id=run_id, task_id="prepare_data"), "params": {}}


def test_heavy_task_job_returns_its_result_through_the_jobs_api_and_a_retry_reattaches(
    ray_head: str, tmp_path: Any
) -> None:
    hook = RayJobHook(CONN_ID)
    op, context = _prepare_job(tmp_path, dataset_url="builtin:copy_digit", val_fraction=0.25)
    prepared = op.execute(context)  # a real Ray job: tokenizer, split, Parquet files
    submission_id = context["ti"].xcoms["ray_submission_id"]
    assert submission_id == derive_submission_id(
        dag_id="it_heavy", run_id=context["ti"].run_id, task_id="prepare_data"
    )
    assert prepared["num_train"] > 0 and prepared["train_url"].endswith("train.parquet")
    assert prepared["manifest"]["counts"]  # the manifest travels with the result: start_tracking reads no folder
    assert str(tmp_path) not in prepared["train_url"]  # written in the cluster's folder, not this side's
    assert "pipeline-job prepare_data" in hook.info(submission_id).entrypoint
    assert f"RLHF_JOB_RESULT {submission_id} " in hook.logs(submission_id)
    # A retry of the task instance finds the finished job: nothing is submitted, the same result comes back.
    jobs = _submission_ids(hook)
    assert op.execute(context) == prepared
    assert _submission_ids(hook) == jobs


def test_heavy_task_job_user_mistake_fails_at_once_and_a_retry_reads_its_own_result(
    ray_head: str, tmp_path: Any
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from rlhf_ops.pipeline.job_results import result_from_logs

    # A form override that the pipeline refuses: the job exits 2 with a non-retryable error as its result.
    op, context = _prepare_job(tmp_path, overrides=["data.train_files=[/etc/passwd]"])
    message = "'data.train_files' may not be set from this pipeline's trigger form"
    with pytest.raises(AirflowFailException, match=message):
        op.execute(context)
    base = context["ti"].xcoms["ray_submission_id"]
    # Cleared by a user: the failed job is not re-attached; -retry1 runs and leaves its own result.
    with pytest.raises(AirflowFailException, match=message):
        op.execute(context)
    assert context["ti"].xcoms["ray_submission_id"] == f"{base}-retry1"
    hook = RayJobHook(CONN_ID)
    results = [result_from_logs(hook.logs(sid), sid) for sid in (base, f"{base}-retry1")]
    assert [r["status"] if r else None for r in results] == ["error", "error"]


def _reward_package(root: Any, name: str, body: str) -> str:
    """A reward package in a folder of its own (not on this interpreter's path, nor in the worker image)."""
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text(body)
    assert importlib.util.find_spec(name) is None
    return str(package)


def test_shipped_reward_module_scores_in_a_ray_job(ray_head: str, tmp_path: Any) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    name = f"team_reward_{secrets.token_hex(3)}"
    folder = _reward_package(
        tmp_path,
        name,
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if solution_str.strip() == ground_truth else 0.25\n",
    )
    # The library's loader by dotted path, as the trainer and the evaluator call it (the operator's allow-list
    # does not name the module: shipping it through the run's policy is what allows it).
    score = (
        "from rlhf_ops.rewards.registry import load_reward_fn; "
        f"fn = load_reward_fn('{name}:score'); print('scores', fn('d', ' 42', '42', {{}}), fn('d', '7', '42', {{}}))"
    )
    policy = {"allowed_code": {"py_modules": [f"{tmp_path}/*"]}, "spec": "team.yaml"}
    op = RayJobOperator(
        task_id="score", entrypoint=f'python -c "{score}"', ray_conn_id=CONN_ID, code_policy=policy, deferrable=False
    )
    ti = _TaskInstance(dag_id="it_code", run_id=_unique("manual"), task_id="score")
    context: Any = {"ti": ti, "params": {"code": {"py_modules": [folder]}}}
    submission_id = str(op.execute(context))
    hook = RayJobHook(CONN_ID)
    assert "scores 1.0 0.25" in hook.logs(submission_id).splitlines()
    assert (hook.info(submission_id).runtime_env or {})["env_vars"]["RLHF_SHIPPED_MODULES"] == name
    # The same code from a pipeline whose spec allows nothing: refused before anything is submitted.
    refused = RayJobOperator(task_id="score", entrypoint="true", ray_conn_id=CONN_ID, code_policy={}, deferrable=False)
    ti = _TaskInstance(dag_id="it_code", run_id=_unique("manual"), task_id="score")
    jobs, refused_context = _submission_ids(hook), {**context, "ti": ti}
    with pytest.raises(AirflowFailException, match=r"^code.py_modules: '.*' may not be shipped from this pipeline's"):
        refused.execute(refused_context)
    assert _submission_ids(hook) == jobs


def test_shipped_code_that_does_not_import_fails_at_once_in_one_line(ray_head: str, tmp_path: Any) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    name = f"team_broken_{secrets.token_hex(3)}"
    folder = _reward_package(tmp_path, name, "import a_package_the_image_lacks\n")
    op, context = _prepare_job(
        tmp_path, code_policy={"code": {"py_modules": [folder]}}, dataset_url="builtin:copy_digit"
    )
    with pytest.raises(AirflowFailException) as failed:
        op.execute(context)
    assert str(failed.value) == (
        f"prepare_data: shipped module '{name}' does not import (ModuleNotFoundError: No module named "
        "'a_package_the_image_lacks'); fix the module, or add the package it needs to the run's code.pip"
    )
    submission_id = context["ti"].xcoms["ray_submission_id"]
    assert RayJobHook(CONN_ID).status(submission_id) == "FAILED"  # nothing left running
    assert "Parquet" not in RayJobHook(CONN_ID).logs(submission_id)  # it stopped before reading any data


def test_a_ray_connection_that_does_not_answer_is_one_line_and_submits_nothing(tmp_path: Any) -> None:
    from airflow.sdk.exceptions import AirflowException

    from rlhf_ops.pipeline.local_stack import free_ports

    (port,) = free_ports(1)
    op = RayJobOperator(
        task_id="t",
        entrypoint="true",
        ray_address=f"http://127.0.0.1:{port}",
        ray_conn_id="ray_none",
        deferrable=False,
    )
    ti = _TaskInstance(dag_id="it_down", run_id=_unique("manual"), task_id="t")
    down: Any = {"ti": ti, "params": {}}
    with pytest.raises(AirflowException) as failed:
        op.execute(down)
    message = str(failed.value)
    assert message.startswith(f"Ray job server http://127.0.0.1:{port} does not answer (") and "\n" not in message
    assert "check the host and port of the 'ray_none' connection (or params.ray_address)" in message
    assert ti.xcoms == {}
