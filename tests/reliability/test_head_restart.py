"""The Ray head going away mid-job, seen from ``RayJobOperator`` deferred on ``RayJobTrigger``.

* The head unreachable for a while (every request to its job server reset) and back with the job: the trigger
  re-attaches, the task succeeds with the one job it submitted.
* The head restarted mid-training (its processes stopped, ``ray start`` again on the same ports, no job history):
  the trigger reports the job lost, the operator resubmits it under the same submission id with resume, and the
  2-rank tiny run ends with every step trained once after its last checkpoint, its metrics equal to an
  uninterrupted run's; one job on the new head, the old driver gone before it started.

The task runs the way Airflow runs a deferred task: ``execute`` until ``TaskDeferred``, the trigger re-created from
its serialized kwargs (what the triggerer does) until its first event, then the named method with the event.
"""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env

configure_airflow_env()  # before anything imports airflow

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from rlhf_airflow.hooks import RayJobHook  # noqa: E402
from rlhf_airflow.operators import RayJobOperator, derive_submission_id  # noqa: E402
from rlhf_airflow.triggers import RayJobTrigger  # noqa: E402
from rlhf_ops.config import dump_config, load_config  # noqa: E402
from rlhf_ops.pipeline.local_stack import Service, ray_head_ports, start_ray_head  # noqa: E402
from rlhf_ops.storage.manifest import read_latest  # noqa: E402
from tests.reliability.conftest import Figures  # noqa: E402
from tests.reliability.test_faults_recovery import COMMON, STEPS, _same_metrics  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]
CONN_ID = "ray_head_restart"
REPO = Path(__file__).resolve().parents[2]


class Head:
    """A private Ray head on fixed ports that can be stopped and started again where it was."""

    def __init__(self, root: Path) -> None:
        self.root, self.ports, self.starts = root, ray_head_ports(), 0
        self.service: Service | None = None

    def start(self) -> float:
        began = time.monotonic()
        self.starts += 1
        self.service = start_ray_head(self.root / f"start{self.starts}", num_cpus=3, ports=self.ports)
        return time.monotonic() - began

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['--dashboard-port']}"


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    head = Head(tmp_path_factory.mktemp("ray_head"))
    head.start()
    try:
        yield head
    finally:
        head.stop()


def _connect(url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    os.environ[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = json.dumps({"conn_type": "ray", "host": host, "port": int(port)})


class _TaskInstance:
    def __init__(self, run_id: str) -> None:
        self.dag_id, self.run_id, self.task_id, self.map_index, self.try_number = "faults", run_id, "train", -1, 1
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = value


def run_deferred(op: RayJobOperator, context: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """``op`` as Airflow runs a deferrable task; ``events`` receives each trigger event as it fires."""
    from airflow.sdk.exceptions import TaskDeferred

    try:
        return str(op.execute(context))  # type: ignore[arg-type]
    except TaskDeferred as deferred:
        pending = deferred
    while True:
        _, kwargs = pending.trigger.serialize()
        trigger = RayJobTrigger(**kwargs)

        async def first(trigger: RayJobTrigger) -> Any:
            return await anext(trigger.run())

        event = asyncio.run(asyncio.wait_for(first(trigger), timeout=900)).payload
        events.append(event)
        try:
            return str(getattr(op, pending.method_name)(context, event, **(pending.kwargs or {})))
        except TaskDeferred as again:
            pending = again


def _operator(entrypoint: str, **kwargs: Any) -> tuple[RayJobOperator, dict[str, Any], str]:
    run_id = f"manual-{secrets.token_hex(3)}"
    op = RayJobOperator(task_id="train", entrypoint=entrypoint, ray_conn_id=CONN_ID, poll_interval=0.5, **kwargs)
    return op, {"ti": _TaskInstance(run_id)}, derive_submission_id(dag_id="faults", run_id=run_id, task_id="train")


def _jobs(url: str) -> list[tuple[str, str]]:
    return sorted(
        (str(j.submission_id), str(j.status)) for j in RayJobHook(CONN_ID, address=url).get_conn().list_jobs()
    )


def test_a_head_that_stops_answering_and_comes_back_with_the_job_is_re_attached(head: Head) -> None:
    from tests.support.fault_proxy import FaultProxy

    sleeper = "python -c \"import time; print('working', flush=True); time.sleep(15); print('done', flush=True)\""
    with FaultProxy(head.url, match=lambda method, path: True) as proxy:
        _connect(proxy.url)
        op, context, base = _operator(sleeper)
        events: list[dict[str, Any]] = []
        outcome: list[Any] = []

        def task() -> None:
            try:
                outcome.append(run_deferred(op, context, events))
            except Exception as exc:  # shown by the assertion below
                outcome.append(exc)

        thread = threading.Thread(target=task, daemon=True)
        thread.start()
        hook = RayJobHook(CONN_ID, address=head.url)  # past the proxy
        deadline = time.monotonic() + 120
        while hook.find_status(base) != "RUNNING":
            assert time.monotonic() < deadline, hook.find_status(base)
            time.sleep(0.2)
        proxy.always = "reset"  # the head stops answering: every request's connection is reset
        time.sleep(8)
        proxy.always = None
        thread.join(timeout=120)
    assert outcome == [base], outcome
    assert [e["status"] for e in events] == ["success"]
    assert "done" in events[0]["log_tail"]
    assert proxy.injected >= 8  # polls failed while it was away (every 0.5 s for 8 s, some already at the client)
    assert [j for j in _jobs(head.url) if j[0].startswith(base)] == [(base, "SUCCEEDED")]  # one job, not two


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    path = tmp_path_factory.mktemp("preset") / "head.yaml"
    overrides = [f"model.path={tiny_model_dir}", *COMMON, "trainer.save_freq=1"]
    path.write_text(dump_config(load_config("tiny-cpu", overrides)))
    return str(path)


def _entrypoint(preset: str, root: Path) -> str:
    return f"{sys.executable} -m workers.entrypoints.train --preset {preset} trainer.checkpoint_root={root}"


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "plugins")])}  # the head sets OMP_NUM_THREADS


def _drivers(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmdline and "workers.entrypoints.train" in cmdline and state != "Z":
                pids.append(int(proc.name))
    return pids


def _wait(what: str, ready: Callable[[], bool], bound_s: float) -> float:
    start = time.monotonic()
    while not ready():
        assert time.monotonic() - start < bound_s, f"{what}: not within {bound_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.slow
def test_a_head_restarted_mid_training_loses_the_job_which_is_resubmitted_and_resumes_exactly(
    head: Head, preset: str, tmp_path: Path, figures: Figures
) -> None:
    _connect(head.url)
    reference_root = tmp_path / "reference"
    op, context, base = _operator(_entrypoint(preset, reference_root), env_vars=_env())
    events: list[dict[str, Any]] = []
    assert run_deferred(op, context, events) == base, events
    reference = _records(reference_root / "tiny-cpu" / "demo")
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))

    root = tmp_path / "restarted"
    run_dir = root / "tiny-cpu" / "demo"
    op, context, base = _operator(_entrypoint(preset, root), env_vars=_env())
    events, outcome = [], []

    def task() -> None:
        try:
            outcome.append(run_deferred(op, context, events))
        except Exception as exc:  # shown by the assertion below
            outcome.append(exc)

    thread = threading.Thread(target=task, daemon=True)
    thread.start()
    _wait("step 2 committed", lambda: (read_latest(run_dir) or 0) >= 2, 600)
    old_drivers = _drivers(str(root))
    assert old_drivers, "no driver of the run found"
    stopped_at = time.monotonic()
    head.stop()  # as `ray stop`: SIGTERM, then SIGKILL, to every process of the head
    logged, committed = len(_records(run_dir)), read_latest(run_dir) or 0
    drivers_gone_s = _wait("the old driver gone", lambda: not _drivers(str(root)), 30)
    restart_s = head.start()  # same ports, a fresh head: no job history
    thread.join(timeout=900)
    recovered_s = time.monotonic() - stopped_at
    assert outcome == [base], (outcome, events)
    assert [e["status"] for e in events] == ["lost", "success"], events
    assert "does not exist on the Ray head" in events[0]["message"]
    assert _jobs(head.url) == [(base, "SUCCEEDED")]  # nothing ran twice: one job, the old driver gone before it
    info = RayJobHook(CONN_ID).info(base)
    assert (info.runtime_env or {}).get("env_vars", {}).get("RLHF_RESUME_MODE") == "auto"
    records = _records(run_dir)
    resumed = records[logged:]
    assert 1 <= committed < STEPS and logged >= committed, (logged, committed)
    assert [r["step"] for r in resumed] == list(range(committed + 1, STEPS + 1)), (logged, committed, resumed)
    _same_metrics(records[:committed] + resumed, reference)
    assert read_latest(run_dir) == STEPS
    figures.record(
        fault="Ray head restarted (stopped, started again on its ports without job history) after step 2",
        old_driver_gone_after_s=round(drivers_gone_s, 2),
        head_restart_s=round(restart_s, 1),
        recovered_after_s=round(recovered_s, 1),
        steps_lost=0,
        steps_repeated=logged - committed,
        ray_jobs_on_new_head=len(_jobs(head.url)),
        processes_left=len(_drivers(str(root))),
    )
    assert _drivers(str(root)) == []
