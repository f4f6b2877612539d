"""The Airflow process that runs ``train`` SIGKILLed mid-job: the task's next run re-attaches to the same Ray job.

``RayJobOperator`` derives its Ray submission id from (dag_id, run_id, task_id, map_index), the same for every try,
and ``RayJobHook.submit`` re-attaches to a PENDING / RUNNING / SUCCEEDED job with that id instead of submitting.
Against a private Ray head (token auth) with a ~25 s job:

* default: a process running the operator (``deferrable=False``: it polls in the worker) and a process running
  ``RayJobTrigger`` (what the triggerer does) are each SIGKILLed mid-job, then run again from scratch;
* slow: a real Airflow deployment (PostgreSQL metadata DB, scheduler + LocalExecutor, triggerer, api-server): the
  triggerer is SIGKILLed while ``train`` is deferred and started again; the LocalExecutor worker running a polling
  ``train`` is SIGKILLed and the scheduler's heartbeat check retries the task.

Each time the job server lists exactly one job under the task's submission id (no ``-retry1``), its driver ran
once (its first log line appears once), and the task returns that id with the job's output.
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env

configure_airflow_env()  # before anything imports airflow

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import quote  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402

from rlhf_airflow.hooks import RayJobHook  # noqa: E402
from rlhf_airflow.operators import RayJobOperator, derive_submission_id  # noqa: E402
from rlhf_ops.pipeline.local_stack import Service, start_ray_head  # noqa: E402
from tests.reliability.conftest import Figures  # noqa: E402
from tests.support.airflow_services import (  # noqa: E402
    AirflowServices,
    _launch,
    airflow_services,
    postgres_database,
    postgres_unavailable_reason,
)

ROOT = Path(__file__).resolve().parents[2]
CONN_ID = "ray_kill"
# ~25 s of driver output, one line a second; the last line is the job's result.
JOB = (
    "python -c \"import time; [(print('step', i, flush=True), time.sleep(1)) for i in range({n})]; "
    "print('result=42', flush=True)\""
)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    """A private Ray head with token auth; the ``ray_kill`` connection points at it. Yields (head, token)."""
    token = secrets.token_hex(16)
    head = start_ray_head(tmp_path_factory.mktemp("ray_head"), auth_token=token, num_cpus=1)
    port = int(head.url.rsplit(":", 1)[1])
    key = f"AIRFLOW_CONN_{CONN_ID.upper()}"
    os.environ[key] = json.dumps({"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": token})
    try:
        yield head, token
    finally:
        os.environ.pop(key, None)
        head.stop()


def _jobs(hook: RayJobHook, base: str) -> list[str]:
    ids = (j.submission_id for j in hook.get_conn().list_jobs())
    return sorted(s for s in ids if s and s.startswith(base))


def _wait_log(hook: RayJobHook, submission_id: str, text: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (hook.logs(submission_id) if hook.find_status(submission_id) else ""):
        assert time.monotonic() < deadline, f"{text!r} not in the log of {submission_id} within {timeout_s} s"
        time.sleep(0.5)


def _check_one_job(hook: RayJobHook, base: str) -> None:
    """One job under ``base``, succeeded, its driver started once and printed its result."""
    assert _jobs(hook, base) == [base]
    assert hook.status(base) == "SUCCEEDED"
    lines = hook.logs(base).splitlines()
    assert lines.count("step 0") == 1 and "result=42" in lines, lines[-5:]


# A worker running the operator's execute() for one task instance. The task instance is a stand-in with what
# execute() reads and writes of Airflow's (the real one is in the slow case).
OPERATOR = r"""
import json, sys
from rlhf_airflow.operators import RayJobOperator

class TaskInstance:
    dag_id, run_id, task_id, map_index = "rlhf_ppo", "manual__2026-12-02T00:00:00+00:00", "train", -1
    try_number = int(sys.argv[3])
    def xcom_push(self, key, value):
        print("xcom", key, value, flush=True)

op = RayJobOperator(task_id="train", entrypoint=sys.argv[2], ray_conn_id=sys.argv[1], deferrable=False,
                    poll_interval=0.5)
print("returned", op.execute({"ti": TaskInstance()}), flush=True)
"""
# A triggerer running the trigger the operator deferred to, re-created from its serialized kwargs.
TRIGGER = r"""
import asyncio, json, sys
from rlhf_airflow.triggers import RayJobTrigger

async def first():
    return await anext(RayJobTrigger(**json.loads(sys.argv[1])).run())

print("event", json.dumps(asyncio.run(first()).payload), flush=True)
"""


def _python(code: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.timeout(600)
def test_a_killed_worker_or_triggerer_reattaches_to_the_same_ray_job(
    ray_head: tuple[Service, str], tmp_path: Path, figures: Figures
) -> None:
    hook = RayJobHook(CONN_ID)
    job = JOB.format(n=25)
    ti = ("rlhf_ppo", "manual__2026-12-02T00:00:00+00:00", "train")
    base = derive_submission_id(dag_id=ti[0], run_id=ti[1], task_id=ti[2])
    assert not _jobs(hook, base)

    # Worker: killed while it polls the job, then the task's next try runs execute() again.
    log = tmp_path / "worker.log"
    first = _python(OPERATOR, CONN_ID, job, "1", log=log)
    _wait_log(hook, base, "step 2")
    _kill(first)
    assert hook.status(base) == "RUNNING"  # SIGKILL runs no on_kill: the job goes on
    retry = _python(OPERATOR, CONN_ID, job, "2", log=log)
    assert retry.wait(timeout=300) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert f"returned {base}" in out and f"xcom ray_submission_id {base}" in out, out[-3000:]
    _check_one_job(hook, base)

    # Triggerer: killed while it watches a job, then a triggerer runs the same trigger again.
    base2 = hook.submit(job, submission_id=derive_submission_id(dag_id=ti[0], run_id=ti[1], task_id="train_deferred"))
    kwargs = json.dumps(
        {
            "dashboard_address": hook.dashboard_address,
            "submission_id": base2,
            "poll_interval": 0.5,
            "ray_conn_id": CONN_ID,
        }
    )
    log = tmp_path / "triggerer.log"
    watcher = _python(TRIGGER, kwargs, log=log)
    _wait_log(hook, base2, "step 2")
    _kill(watcher)
    again = _python(TRIGGER, kwargs, log=log)
    assert again.wait(timeout=300) == 0, log.read_text()[-3000:]
    event = json.loads(log.read_text().split("event ", 1)[1].splitlines()[0])
    assert (event["status"], event["submission_id"]) == ("success", base2)
    op = RayJobOperator(task_id="train", entrypoint=job, ray_conn_id=CONN_ID)
    assert op.execute_complete({}, event) == base2  # what the task returns when it resumes
    _check_one_job(hook, base2)
    figures.record(
        orchestrator_kills=2,
        orchestrator_jobs_per_task=1,
        orchestrator_second_jobs=0,
        orchestrator_tasks_succeeded=2,
    )


# ---- slow: a real Airflow deployment -------------------------------------------------------------------------
DAG_FILE = """
import datetime
import pendulum
from airflow.sdk import DAG
from rlhf_airflow.operators import RayJobOperator

for dag_id, deferrable in (("kill_triggerer", True), ("kill_worker", False)):
    with DAG(dag_id, schedule=None, start_date=pendulum.datetime(2025, 1, 1, tz="UTC"), catchup=False,
             default_args={{"retries": 2, "retry_delay": datetime.timedelta(seconds=2)}}) as dag:
        RayJobOperator(task_id="train", entrypoint={job!r}, ray_conn_id="ray_default", deferrable=deferrable,
                       poll_interval=1)
    globals()[dag_id] = dag
"""
# Short enough for a test, long enough for a slow machine: a dead triggerer's triggers move after 10 s without
# a heartbeat; a task whose worker stopped heartbeating is failed (and retried) after 20 s.
FAST_RECOVERY = {
    "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "10",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "20",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
}


@pytest.fixture(scope="module")
def airflow(ray_head: tuple[Service, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[AirflowServices]:
    """PostgreSQL DB and the four Airflow components with the two DAGs unpaused; ``ray_default`` is the head."""
    if reason := postgres_unavailable_reason():
        pytest.fail(f"{reason} (Airflow's metadata DB for this test)")
    head, token = ray_head
    root = tmp_path_factory.mktemp("airflow_kill")
    dags = root / "dags"
    dags.mkdir()
    (dags / "kill_dags.py").write_text(DAG_FILE.format(job=JOB.format(n=150)))
    port = int(head.url.rsplit(":", 1)[1])
    env = {
        "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
            {"conn_type": "ray", "host": "127.0.0.1", "port": port, "password": token}
        ),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        **FAST_RECOVERY,
    }
    with (
        postgres_database() as db,
        airflow_services(
            root / "airflow", db_url=db.url, dags_folder=dags, plugins_folder=ROOT / "plugins", extra_env=env
        ) as af,
    ):
        token_ = af.token()
        for dag_id in ("kill_triggerer", "kill_worker"):
            deadline = time.monotonic() + 180
            while (status := af.request("GET", f"/api/v2/dags/{dag_id}", token=token_)[0]) == 404:
                assert time.monotonic() < deadline, f"{dag_id} not parsed"
                time.sleep(2)
            assert status == 200
            assert af.request("PATCH", f"/api/v2/dags/{dag_id}", token=token_, body={"is_paused": False})[0] == 200
        yield af


def _ti(af: AirflowServices, token: str, dag_id: str, run_id: str) -> dict[str, object]:
    status, body = af.request(
        "GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/train", token=token
    )
    return dict(body) if status == 200 else {}


def _wait_ti(
    af: AirflowServices, token: str, dag_id: str, run_id: str, state: str, timeout_s: float = 300
) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while (ti := _ti(af, token, dag_id, run_id)).get("state") != state:
        assert ti.get("state") not in ("failed", "upstream_failed"), ti
        assert time.monotonic() < deadline, f"train of {dag_id} not {state} within {timeout_s} s: {ti}"
        time.sleep(1)
    return ti


def _worker_processes(af: AirflowServices) -> list[psutil.Process]:
    """The LocalExecutor worker running a task (``airflow worker -- LocalExecutor: <task>``) and its task process."""
    scheduler = psutil.Process(af.procs["scheduler"].pid)
    found = []
    for proc in scheduler.children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if title.startswith("airflow worker -- ") and "<idle>" not in title:
            found.append(proc)
    return found


def _kill_triggerer(af: AirflowServices) -> int:
    proc = af.procs["triggerer"]
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for member in tree:
        member.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _launch(af, "triggerer")  # what a process supervisor does
    return len(tree)


def _kill_worker(af: AirflowServices) -> int:
    tree = _worker_processes(af)
    assert tree, "no LocalExecutor worker is running train"
    for member in tree:
        member.send_signal(signal.SIGKILL)
    return len(tree)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("dag_id", "state", "kill"),
    [("kill_triggerer", "deferred", _kill_triggerer), ("kill_worker", "running", _kill_worker)],
)
def test_airflow_component_killed_while_train_runs_reattaches_to_the_same_ray_job(
    airflow: AirflowServices, dag_id: str, state: str, kill: Callable[[AirflowServices], int], figures: Figures
) -> None:
    af = airflow
    token = af.token()
    status, run = af.request("POST", f"/api/v2/dags/{dag_id}/dagRuns", token=token, body={"logical_date": None})
    assert status == 200, run
    run_id = run["dag_run_id"]
    base = derive_submission_id(dag_id=dag_id, run_id=run_id, task_id="train")
    hook = RayJobHook(CONN_ID)  # the same head as the tasks' ray_default
    _wait_ti(af, token, dag_id, run_id, state)
    _wait_log(hook, base, "step 2")
    killed_processes = kill(af)
    killed_at = time.monotonic()
    assert hook.status(base) == "RUNNING"
    ti = _wait_ti(af, token, dag_id, run_id, "success", timeout_s=600)
    recovered_s = time.monotonic() - killed_at
    status, xcom = af.request(
        "GET",
        f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/train/xcomEntries/return_value",
        token=token,
    )
    assert status == 200 and xcom["value"] == base, xcom
    _check_one_job(hook, base)
    logs = "\n".join(
        p.read_text(errors="replace")
        for p in (af.home / "logs").rglob("attempt=*.log")
        if f"dag_id={dag_id}" in str(p)
    )
    reattached = re.search(rf"Ray job {base} is (RUNNING|SUCCEEDED): re-attaching instead of submitting", logs)
    if dag_id == "kill_worker":  # the scheduler failed the silent try and ran the next one, which re-attached
        assert ti["try_number"] == 2, ti
        # RUNNING here; SUCCEEDED if this machine took longer than the job to start the retry (still no new job).
        assert reattached, logs[-3000:]
    figures.record(
        **{
            f"{dag_id}_kills": 1,
            f"{dag_id}_processes_killed": killed_processes,
            f"{dag_id}_try_number": ti["try_number"],
            f"{dag_id}_seconds_to_success": round(recovered_s, 1),
            f"{dag_id}_jobs_for_the_task": 1,
        }
    )
    if dag_id == "kill_worker":  # (a killed triggerer's task resumes its trigger: nothing is submitted again)
        figures.record(kill_worker_retry_found_the_job_running=int(bool(reattached and reattached[1] == "RUNNING")))
