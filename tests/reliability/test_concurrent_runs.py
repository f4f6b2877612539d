"""Several ``rlhf_ppo`` runs at once, each with its own params, through a real Airflow deployment: they stay isolated.

One stack for the module: a fresh PostgreSQL database as Airflow's metadata DB and the four Airflow components
(LocalExecutor, the ``rlhf_cluster`` pool with 4 slots counting deferred tasks; ``tests/support/airflow_services.py``),
an MLflow server, moto S3 as the checkpoints' remote store and a private Ray head with token auth and 4 logical CPUs
(a tiny-cpu run reserves 1: 2 ranks x 0.5), so four trainings fit at once on this 2-core machine. Every run shares
the work folder (``$RLHF_WORK_DIR``), the remote store, the MLflow experiment and the registered model.

* one run alone (the baseline wall time);
* two runs triggered at once through the REST API (issue 12), with different seeds, learning rates and step counts;
* four at once (issue 15's load case), while a thread asks the Ray job server (``GET /api/jobs/``) and the MLflow
  server (``POST /api/2.0/mlflow/experiments/search``) for an answer every second and records the slowest.

Isolation, for each run: its own data folder, local run folder and remote prefix with exactly its checkpoint
(``global_step_<its steps>``, ``latest``) and ``metrics.jsonl`` of its steps; its own MLflow run carrying its
params (seed, learning rate, run folder) and a metric history of its steps; its own Ray job (one submission, no
``-retry``), SUCCEEDED, whose entrypoint names its run folder only; no file or text of one run under another's
folders. The Ray jobs overlap in time (they ran at once, not one after the other). Everything here is slow
(minutes each); the default suite checks the same derivations in ``tests/unit/pipeline/test_concurrent_isolation.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import requests

from rlhf_ops.pipeline.local_stack import start_ray_head
from tests.reliability.conftest import Figures
from tests.support.airflow_services import (
    AirflowServices,
    airflow_services,
    postgres_database,
    postgres_unavailable_reason,
)
from tests.support.mlflow_server import mlflow_server
from tests.support.moto_server import REGION, running_moto_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DAG_ID = "rlhf_ppo"
BUCKET = "rlhf-concurrent"
RAY_CPUS = 4
LATENCY_BOUND_S = 5.0
# Small runs: the preset's save_freq (50) commits one checkpoint, at the last step; one evaluation each.
BASE_CONF: dict[str, Any] = {
    "rollout_n": 4,
    "eval_max_prompts": 16,
    "eval_n_samples": 2,
    "keep_last": 1,
    "remote_store_url": f"s3://{BUCKET}/runs",
}
_TIMES: dict[str, float] = {}  # wall seconds by case, for the ratios against one run alone


@dataclass(frozen=True)
class Stack:
    airflow: AirflowServices
    token: str
    tracking_uri: str
    ray_dashboard: str
    ray_token: str
    work_dir: Path
    s3: Any


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """PostgreSQL DB, moto S3, MLflow, a 4-CPU Ray head and the four Airflow components, stopped by PID."""
    if reason := postgres_unavailable_reason():
        pytest.fail(f"{reason} (Airflow's metadata DB for this test; PostgreSQL must listen on 127.0.0.1:5432)")
    root = tmp_path_factory.mktemp("concurrent")
    dags = root / "dags"
    shutil.copytree(ROOT / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    saved = dict(os.environ)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.update(
        {
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }
    )
    ray_token = secrets.token_hex(16)
    try:
        with contextlib.ExitStack() as services:
            moto = services.enter_context(running_moto_server())
            moto.create_bucket(BUCKET)
            tracking_uri = services.enter_context(mlflow_server(root=root / "mlflow"))
            head = start_ray_head(root / "ray", auth_token=ray_token, num_cpus=RAY_CPUS)
            services.callback(head.stop)
            db = services.enter_context(postgres_database())
            env = {
                "AIRFLOW_CONN_RAY_DEFAULT": json.dumps(
                    {
                        "conn_type": "ray",
                        "host": "127.0.0.1",
                        "port": int(head.url.rsplit(":", 1)[1]),
                        "password": ray_token,
                    }
                ),
                "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps({"conn_type": "http", "host": tracking_uri}),
                "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
                    {
                        "conn_type": "aws",
                        "login": "testing",
                        "password": "testing",
                        "extra": {"endpoint_url": moto.endpoint_url, "region_name": REGION},
                    }
                ),
                "RLHF_WORK_DIR": str(root / "work"),
                "RLHF_MLFLOW_UI_URL": tracking_uri,
                "MLFLOW_DISABLE_TELEMETRY": "true",
            }
            af = services.enter_context(
                airflow_services(
                    root / "airflow", db_url=db.url, dags_folder=dags, plugins_folder=ROOT / "plugins", extra_env=env
                )
            )
            stack = Stack(
                airflow=af,
                token=af.token(),
                tracking_uri=tracking_uri,
                ray_dashboard=head.url,
                ray_token=ray_token,
                work_dir=root / "work",
                s3=moto.client(),
            )
            _unpause(stack)
            yield stack
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _api(stack: Stack, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return stack.airflow.request(method, path, token=stack.token, body=body)


def _unpause(stack: Stack) -> None:
    deadline = time.monotonic() + 180
    status, body = _api(stack, "GET", f"/api/v2/dags/{DAG_ID}")
    while status == 404 and time.monotonic() < deadline:
        time.sleep(2)
        status, body = _api(stack, "GET", f"/api/v2/dags/{DAG_ID}")
    assert status == 200, body
    status, body = _api(stack, "PATCH", f"/api/v2/dags/{DAG_ID}", {"is_paused": False})
    assert status == 200 and body["is_paused"] is False, body


def _run_path(run_id: str) -> str:
    return f"/api/v2/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}"


def _xcom(stack: Stack, run_id: str, task_id: str, key: str = "return_value") -> Any:
    status, body = _api(stack, "GET", f"{_run_path(run_id)}/taskInstances/{task_id}/xcomEntries/{key}")
    assert status == 200, body
    return body["value"]


def _task_states(stack: Stack, run_id: str) -> dict[str, str]:
    status, body = _api(stack, "GET", f"{_run_path(run_id)}/taskInstances?limit=100")
    assert status == 200, body
    return {f"{ti['task_id']}[{ti['map_index']}]": str(ti["state"]) for ti in body["task_instances"]}


def _wait_all(stack: Stack, run_ids: list[str], timeout_s: float) -> None:
    """Until every run succeeded; a failed run (or the deadline) fails with every run's task states."""
    deadline = time.monotonic() + timeout_s
    pending = set(run_ids)
    while pending:
        for run_id in sorted(pending):
            status, run = _api(stack, "GET", _run_path(run_id))
            assert status == 200, run
            if run["state"] == "success":
                pending.discard(run_id)
            elif run["state"] == "failed":
                raise AssertionError(f"run {run_id} failed: {_task_states(stack, run_id)}\n{_errors(stack, run_id)}")
        if pending and time.monotonic() > deadline:
            states = {r: _task_states(stack, r) for r in sorted(pending)}
            raise AssertionError(f"not done after {timeout_s:.0f} s: {states}")
        time.sleep(3)


def _errors(stack: Stack, run_id: str) -> str:
    folder = stack.airflow.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
    lines = [
        f"{log.relative_to(folder)}: {line[:600]}"
        for log in sorted(folder.rglob("attempt=*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if '"level":"error"' in line
    ]
    return "\n".join(lines[:12]) or "(no error lines in the task logs)"


@dataclass
class LatencyProbe:
    """Asks the Ray job server and the MLflow server for an answer every second; keeps the slowest per server."""

    stack: Stack
    max_s: dict[str, float] = field(default_factory=lambda: {"ray": 0.0, "mlflow": 0.0})
    samples: dict[str, int] = field(default_factory=lambda: {"ray": 0, "mlflow": 0})
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _once(self, name: str, call: Any) -> None:
        start = time.monotonic()
        try:
            resp = call()
            if resp.status_code != 200:
                self.failures.append(f"{name}: HTTP {resp.status_code} {resp.text[:200]}")
        except requests.RequestException as exc:  # a timeout counts as its full length
            self.failures.append(f"{name}: {exc!r}")
        elapsed = time.monotonic() - start
        self.max_s[name] = max(self.max_s[name], elapsed)
        self.samples[name] += 1

    def _loop(self) -> None:
        headers = {"Authorization": f"Bearer {self.stack.ray_token}"}
        ray_jobs = f"{self.stack.ray_dashboard}/api/jobs/"
        search = f"{self.stack.tracking_uri}/api/2.0/mlflow/experiments/search"
        while not self._stop.is_set():
            tick = time.monotonic()
            self._once("ray", lambda: requests.get(ray_jobs, headers=headers, timeout=30))
            self._once("mlflow", lambda: requests.post(search, json={"max_results": 50}, timeout=30))
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))

    def __enter__(self) -> LatencyProbe:
        self._thread = threading.Thread(target=self._loop, name="latency-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=60)


def _confs(count: int, tag: str) -> list[tuple[str, dict[str, Any], int, float, int]]:
    """``(dag_run_id, conf, steps, lr, seed)`` per run: seeds 1.., learning rates and step counts differ."""
    runs = []
    for i in range(count):
        steps, lr, seed = 2 + i % 2, [2e-3, 1e-3, 5e-4, 2.5e-4][i % 4], 11 + i
        conf = {
            **BASE_CONF,
            "total_training_steps": steps,
            "learning_rate": lr,
            "overrides": ["trainer.test_freq=0", "trainer.val_before_train=false", f"trainer.seed={seed}"],
        }
        runs.append((f"{tag}_{i}_{secrets.token_hex(3)}", conf, steps, lr, seed))
    return runs


def _trigger_all(stack: Stack, runs: list[tuple[str, dict[str, Any], int, float, int]]) -> float:
    """POST every run back to back (one thread each, so they are queued together); returns the start time."""
    start = time.monotonic()
    answers: dict[str, tuple[int, Any]] = {}

    def post(run_id: str, conf: dict[str, Any]) -> None:
        body = {"dag_run_id": run_id, "logical_date": None, "conf": conf}
        answers[run_id] = _api(stack, "POST", f"/api/v2/dags/{DAG_ID}/dagRuns", body)

    threads = [threading.Thread(target=post, args=(run_id, conf)) for run_id, conf, *_ in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for run_id, (status, body) in answers.items():
        assert status == 200, (run_id, body)
    assert len(answers) == len(runs)
    return start


def _ray_jobs(stack: Stack) -> list[Any]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(stack.ray_dashboard, headers={"Authorization": f"Bearer {stack.ray_token}"})
    return list(client.list_jobs())


def _s3_keys(stack: Stack, prefix: str) -> list[str]:
    pages = stack.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def _text_files(folder: Path) -> Iterator[Path]:
    for path in folder.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".yaml", ".txt", "") and path.stat().st_size < 2**22:
            yield path


def _check_isolated(stack: Stack, runs: list[tuple[str, dict[str, Any], int, float, int]]) -> dict[str, Any]:
    """Every isolation assertion of the module docstring; returns what was checked, by run."""
    from mlflow import MlflowClient

    from rlhf_airflow.operators import derive_submission_id

    client = MlflowClient(stack.tracking_uri)
    jobs = {job.submission_id: job for job in _ray_jobs(stack) if job.submission_id}
    seen: dict[str, dict[str, Any]] = {}
    for run_id, _conf, steps, lr, seed in runs:
        states = _task_states(stack, run_id)
        assert states.pop("fetch_champion[-1]") == "skipped", states  # warm_start: scratch
        assert {s for t, s in states.items() if t != "promote_champion[-1]"} == {"success"}, states
        layout = _xcom(stack, run_id, "preflight", "layout")
        key = layout["run_key"]
        prepared = _xcom(stack, run_id, "prepare_data")
        mlflow_run_id = _xcom(stack, run_id, "start_tracking", "mlflow_run_id")
        submission = _xcom(stack, run_id, "train", "ray_submission_id")
        # Data: the run's own folder under the shared work folder.
        data_dir = Path(layout["data_root"]) / key
        assert Path(prepared["train_url"].removeprefix("file://")).parent == data_dir, prepared["train_url"]
        assert (data_dir / "manifest.json").is_file()
        # Checkpoints: exactly the run's own last step, locally and on S3, with metrics of its steps.
        run_dir = Path(layout["local_run_dir"])
        assert run_dir == stack.work_dir / "checkpoints" / DAG_ID / key
        assert sorted(p.name for p in run_dir.glob("global_step_*")) == [f"global_step_{steps}"]
        assert (run_dir / "latest").read_text().strip() == f"global_step_{steps}"
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert [int(row["step"]) for row in lines] == list(range(1, steps + 1))
        prefix = f"runs/{DAG_ID}/{key}/"
        remote = {k.removeprefix(prefix) for k in _s3_keys(stack, prefix)}
        assert f"global_step_{steps}/MANIFEST.json" in remote and "latest" in remote, sorted(remote)
        assert {k.split("/", 1)[0] for k in remote if k.startswith("global_step_")} == {f"global_step_{steps}"}
        # MLflow: the run's own params and a metric history of its own steps.
        mlflow_run = client.get_run(mlflow_run_id)
        params = mlflow_run.data.params
        assert params["trainer.run_name"] == key and params["trainer.seed"] == str(seed)
        assert float(params["actor.optim.lr"]) == pytest.approx(lr)
        assert params["trainer.total_training_steps"] == str(steps)
        assert mlflow_run.data.tags["airflow.run_id"] == run_id
        assert [m.step for m in client.get_metric_history(mlflow_run_id, "actor/pg_loss")] == list(range(1, steps + 1))
        # Ray: one job for the task (no -retry), its own id, succeeded, training this run's folder only.
        assert submission == derive_submission_id(dag_id=DAG_ID, run_id=run_id, task_id="train")
        assert sorted(s for s in jobs if s.startswith(submission)) == [submission]
        job = jobs[submission]
        assert str(job.status) in ("SUCCEEDED", "JobStatus.SUCCEEDED"), job.status
        assert f'trainer.run_name="{key}"' in job.entrypoint or f"trainer.run_name={key}" in job.entrypoint
        seen[run_id] = {
            "key": key,
            "mlflow_run_id": mlflow_run_id,
            "mlflow_name": mlflow_run.info.run_name,
            "submission": submission,
            "folders": [data_dir, run_dir, Path(layout["cache_dir"])],
            "prefix": prefix,
            "job_window": (job.start_time, job.end_time),
        }
    for field_name in ("key", "mlflow_run_id", "mlflow_name", "submission"):
        values = [info[field_name] for info in seen.values()]
        assert len(set(values)) == len(values), (field_name, values)
    # No file (nor any text in the run's JSON / YAML files) of one run under another's folders or S3 prefix.
    for run_id, info in seen.items():
        others = [other["key"] for other_id, other in seen.items() if other_id != run_id]
        for folder in info["folders"]:
            for path in folder.rglob("*") if folder.exists() else ():
                assert not any(k in str(path) for k in others), path
            for path in _text_files(folder) if folder.exists() else ():
                text = path.read_text(errors="replace")
                assert not any(k in text for k in others), path
        for s3_key in _s3_keys(stack, info["prefix"]):
            assert not any(k in s3_key for k in others), s3_key
    top = {p.name for p in (stack.work_dir / "checkpoints" / DAG_ID).iterdir()}
    assert {info["key"] for info in seen.values()} <= top
    return seen


def _overlap_s(seen: dict[str, Any]) -> float:
    """Seconds during which every run's Ray job was running at once (> 0: they all ran concurrently)."""
    starts = [info["job_window"][0] for info in seen.values()]
    ends = [info["job_window"][1] for info in seen.values()]
    return (min(ends) - max(starts)) / 1000.0


def _run_batch(stack: Stack, count: int, tag: str, timeout_s: float) -> tuple[float, dict[str, Any], LatencyProbe]:
    runs = _confs(count, tag)
    with LatencyProbe(stack) as probe:
        start = _trigger_all(stack, runs)
        _wait_all(stack, [r[0] for r in runs], timeout_s)
        wall = time.monotonic() - start
    seen = _check_isolated(stack, runs)
    return wall, seen, probe


def _ratio(name: str, wall: float) -> dict[str, float]:
    """``{name: wall / the lone run's wall}`` when the baseline ran in this session (else nothing)."""
    return {name: round(wall / _TIMES["alone"], 2)} if "alone" in _TIMES else {}


@pytest.mark.timeout(900)
def test_one_run_alone(stack: Stack, figures: Figures) -> None:
    """The baseline: one 3-step run (the longest of the concurrent ones) by itself."""
    runs = _confs(2, "alone")[1:]  # the 3-step conf
    start = _trigger_all(stack, runs)
    _wait_all(stack, [runs[0][0]], 600)
    _TIMES["alone"] = time.monotonic() - start
    _check_isolated(stack, runs)
    figures.record(concurrent_1_wall_seconds=round(_TIMES["alone"], 1))


@pytest.mark.timeout(1200)
def test_two_runs_at_once_stay_isolated(stack: Stack, figures: Figures) -> None:
    wall, seen, probe = _run_batch(stack, 2, "pair", timeout_s=900)
    overlap = _overlap_s(seen)
    assert overlap > 0, f"the two Ray jobs did not run at once (overlap {overlap:.1f} s)"
    assert not probe.failures, probe.failures[:5]
    figures.record(
        concurrent_2_runs=2,
        concurrent_2_wall_seconds=round(wall, 1),
        concurrent_2_jobs_overlap_seconds=round(overlap, 1),
        concurrent_2_cross_run_files=0,
        **_ratio("concurrent_2_vs_one", wall),
    )


@pytest.mark.timeout(1800)
def test_four_runs_at_once_under_load(stack: Stack, figures: Figures) -> None:
    wall, seen, probe = _run_batch(stack, 4, "load", timeout_s=1500)
    overlap = _overlap_s(seen)
    figures.record(
        concurrent_4_runs=4,
        concurrent_4_wall_seconds=round(wall, 1),
        concurrent_4_jobs_overlap_seconds=round(overlap, 1),
        concurrent_4_cross_run_files=0,
        latency_max_seconds_ray=round(probe.max_s["ray"], 2),
        latency_max_seconds_mlflow=round(probe.max_s["mlflow"], 2),
        latency_samples=sum(probe.samples.values()),
        latency_failures=len(probe.failures),
        **_ratio("concurrent_4_vs_one", wall),
    )
    assert overlap > 0, f"the four Ray jobs were never all running at once (overlap {overlap:.1f} s)"
    assert not probe.failures, probe.failures[:5]
    assert probe.samples["ray"] >= wall * 0.5 and probe.samples["mlflow"] >= wall * 0.5, probe.samples
    for name, slowest in probe.max_s.items():
        assert slowest < LATENCY_BOUND_S, f"{name} took {slowest:.2f} s to answer (bound {LATENCY_BOUND_S} s)"
