"""``rlhf demo``: the whole pipeline on embedded defaults, on this machine, in a few minutes.

It lays out ``.rlhf/`` (Airflow home with a SQLite DB, MLflow store, work folder, local-folder checkpoint
store), migrates Airflow's DB, starts a private Ray head (job server) and an MLflow server on 127.0.0.1, runs
the ``rlhf_ppo`` DAG on the tiny-cpu preset with ``dag.test()`` (every task in this process, the training as
a real Ray job), stops both servers by PID, and prints where the MLflow run, the checkpoints and the eval
results are and how to open the Airflow and MLflow UIs on them. ``--postgres`` puts Airflow's and MLflow's
databases in PostgreSQL on 127.0.0.1:5432 instead (databases ``rlhf_airflow`` and ``rlhf_mlflow``, created
when missing; needs a PostgreSQL driver, ``psycopg2-binary``, in the environment).

Airflow reads its settings when ``airflow`` is first imported, so the demo sets the environment first and
refuses to run in a process that already imported it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rlhf_ops

DAG_ID = "rlhf_ppo"
MLFLOW_UI_PORT = 5000
AIRFLOW_UI_PORT = 8080
PG_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432"


@dataclass(kw_only=True)
class DemoResult:
    """What the demo produced."""

    state: str
    seconds: float
    mlflow_run_url: str | None = None
    checkpoints: str | None = None
    remote: str | None = None
    eval_files: list[str] = field(default_factory=list)
    registered: dict[str, Any] | None = None
    commands: dict[str, str] = field(default_factory=dict)


def dags_folder() -> Path:
    """The repository's ``dags/`` (the demo runs from a source checkout)."""
    folder = Path(rlhf_ops.__file__).resolve().parents[1] / "dags"
    if not (folder / f"{DAG_ID}.py").is_file():
        raise RuntimeError(f"{folder}/{DAG_ID}.py not found: run the demo from a checkout of the repository")
    return folder


def airflow_env(root: Path, *, postgres: bool) -> dict[str, str]:
    """Airflow settings of the demo (also written to ``<root>/airflow/env.sh`` for the UI command)."""
    home = root / "airflow"
    db = f"{PG_URL}/rlhf_airflow" if postgres else f"sqlite:///{home / 'airflow.db'}"
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder()),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",  # local demo UI without a login
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW__RLHF__CHECKPOINT_TASK_ID": "preflight",
        "RLHF_WORK_DIR": str(root / "work"),
        "RLHF_MLFLOW_UI_URL": f"http://127.0.0.1:{MLFLOW_UI_PORT}",
    }


def _write_env_file(path: Path, env: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items())))


def _migrate(timeout_s: float = 600.0) -> None:
    cli = Path(sys.executable).with_name("airflow")
    done = subprocess.run([str(cli), "db", "migrate"], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _connections(*, mlflow_url: str, ray_url: str) -> dict[str, str]:
    mlflow_port, ray_port = mlflow_url.rsplit(":", 1)[1], ray_url.rsplit(":", 1)[1]
    return {
        "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps(
            {"conn_type": "http", "host": "127.0.0.1", "port": int(mlflow_port)}
        ),
        "AIRFLOW_CONN_RAY_DEFAULT": json.dumps({"conn_type": "ray", "host": "127.0.0.1", "port": int(ray_port)}),
        "AIRFLOW_CONN_AWS_DEFAULT": json.dumps({"conn_type": "aws"}),  # the local-folder store needs no keys
    }


def _run_dag(conf: dict[str, Any]) -> Any:
    from airflow.dag_processing.dagbag import BundleDagBag

    folder = dags_folder()
    bag = BundleDagBag(dag_folder=str(folder), bundle_path=folder, bundle_name="dags-folder")
    if bag.import_errors:
        raise RuntimeError(f"the DAGs folder has import errors: {bag.import_errors}")
    return bag.dags[DAG_ID].test(run_conf=conf)


def _xcom(run_id: str, task_id: str, key: str = "return_value") -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(run_id=run_id, dag_ids=DAG_ID, task_ids=task_id, key=key)
        row = session.execute(query.with_only_columns(XComModel.value)).first()
    return None if row is None else _decode(row[0])


def _decode(value: Any) -> Any:
    """XCom rows hold JSON, and values pushed by tasks are JSON-encoded once more: undo both."""
    for _ in range(2):
        if not isinstance(value, str | bytes):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value


def _mlflow_start(root: Path, *, postgres: bool) -> Any:
    from rlhf_ops.entrypoints.local_stack import ensure_postgres_databases, start_mlflow_server

    backend = None
    if postgres:
        ensure_postgres_databases(["rlhf_airflow", "rlhf_mlflow"])
        backend = f"{PG_URL}/rlhf_mlflow"  # SQLAlchemy 2.1 defaults postgresql:// to psycopg 3
    return start_mlflow_server(root / "mlflow", backend_store_uri=backend), backend


def run_demo(
    root: Path = Path(".rlhf"), *, postgres: bool = False, steps: int | None = None, echo: Callable[[str], Any] = print
) -> DemoResult:
    """Run the pipeline once on embedded defaults; see the module docstring.

    Args:
        root: Folder for everything the demo writes.
        postgres: Use PostgreSQL at 127.0.0.1:5432 for Airflow's and MLflow's databases.
        steps: Training steps (None: the tiny-cpu preset's).
        echo: Where progress lines go.
    """
    from rlhf_ops.entrypoints.local_stack import start_ray_head

    if "airflow" in sys.modules:
        raise RuntimeError("run the demo in a fresh process: airflow was already imported with other settings")
    start, root = time.monotonic(), root.absolute()
    env = airflow_env(root, postgres=postgres)
    os.environ.update(env)
    _write_env_file(root / "airflow" / "env.sh", env)
    echo(f"[demo] Airflow home {env['AIRFLOW_HOME']} ({'PostgreSQL' if postgres else 'SQLite'}); migrating")
    mlflow, backend = _mlflow_start(root, postgres=postgres)
    ray = None
    try:
        _migrate()
        echo(f"[demo] MLflow server {mlflow.url}; starting a Ray head with its job server")
        ray = start_ray_head(root / "logs", num_cpus=2)
        echo(f"[demo] Ray dashboard {ray.url}; running {DAG_ID} with dag.test()")
        os.environ.update(_connections(mlflow_url=mlflow.url, ray_url=ray.url))
        conf: dict[str, Any] = {
            "preset": "tiny-cpu",
            "work_dir": str(root / "work"),
            "remote_store_url": (root / "remote").as_uri(),
            "ray_address": ray.url,
        }
        if steps is not None:
            conf.update(total_training_steps=steps, save_freq=max(1, steps // 2))
        dag_run = _run_dag(conf)
        result = _collect(dag_run, start=start)
    finally:
        if ray is not None:
            ray.stop()
        mlflow.stop()
    result.commands = _ui_commands(root, backend=backend)
    _report(result, echo)
    return result


def _collect(dag_run: Any, *, start: float) -> DemoResult:
    plan_layout = _xcom(dag_run.run_id, "preflight", "layout") or {}
    local = plan_layout.get("local_run_dir")
    found = Path(local).glob("global_step_*/eval.json") if local else []
    eval_files = [str(p) for p in sorted(found, key=lambda p: int(p.parent.name.removeprefix("global_step_")))]
    return DemoResult(
        state=str(dag_run.state),
        seconds=time.monotonic() - start,
        mlflow_run_url=_xcom(dag_run.run_id, "start_tracking", "mlflow_run_url"),
        checkpoints=local,
        remote=plan_layout.get("remote_run_url"),
        eval_files=eval_files,
        registered=_xcom(dag_run.run_id, "register_model"),
    )


def _ui_commands(root: Path, *, backend: str | None) -> dict[str, str]:
    bin_dir = Path(sys.executable).parent
    store = backend or f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    env_file = root / "airflow" / "env.sh"
    return {
        "airflow": f"source {env_file} && {bin_dir / 'airflow'} api-server --host 127.0.0.1 --port {AIRFLOW_UI_PORT}",
        "mlflow": (
            f"{bin_dir / 'mlflow'} server --host 127.0.0.1 --port {MLFLOW_UI_PORT} --workers 1 "
            f"--backend-store-uri {store} --artifacts-destination {(root / 'mlflow' / 'artifacts').as_uri()}"
        ),
    }


def _headline(eval_file: str) -> str:
    metrics = json.loads(Path(eval_file).read_text()).get("metrics") or {}
    keys = ("eval/reward/mean", "eval/acc", "eval/pass_at_4")
    return ", ".join(f"{k}={metrics[k]:.3f}" for k in keys if isinstance(metrics.get(k), int | float))


def _report(result: DemoResult, echo: Callable[[str], Any]) -> None:
    registered = result.registered or {}
    lines = [
        "",
        f"[demo] DAG run {result.state}; {result.seconds:.0f} s since the demo started",
        f"  MLflow run:      {result.mlflow_run_url}",
        f"  checkpoints:     {result.checkpoints}",
        f"  remote store:    {result.remote}",
        *[f"  eval results:    {path}  ({_headline(path)})" for path in result.eval_files],
        f"  registered:      {registered.get('registered_name')} v{registered.get('version')} "
        f"(best step {registered.get('best_step')}, {registered.get('metric')}={registered.get('value')}, "
        f"champion moved: {registered.get('promoted')})",
        "",
        "Open the UIs (each in its own terminal):",
        f"  Airflow: {result.commands['airflow']}",
        f"           then http://127.0.0.1:{AIRFLOW_UI_PORT}/dags/{DAG_ID}",
        f"  MLflow:  {result.commands['mlflow']}",
        f"           then {result.mlflow_run_url}",
    ]
    for line in lines:
        echo(line)
