"""``rlhf demo`` (``python -m rlhf_airflow.demo``): the whole pipeline on embedded defaults, on this machine.

It lays out ``.rlhf/`` (Airflow home with a SQLite DB, MLflow store, work folder, local-folder checkpoint
store), migrates Airflow's DB, starts a private Ray head (job server) and an MLflow server on 127.0.0.1, runs
the ``rlhf_ppo`` DAG on the tiny-cpu preset with ``dag.test()`` (every task in this process, the training as
a real Ray job), stops both servers by PID, and prints where the MLflow run, the checkpoints and the eval
results are and how to open the Airflow and MLflow UIs on them. ``--postgres`` puts Airflow's and MLflow's
databases in PostgreSQL on 127.0.0.1:5432 instead (databases ``rlhf_airflow`` and ``rlhf_mlflow``, created
when missing; needs a PostgreSQL driver, ``psycopg2-binary``, in the environment).

Airflow reads its settings when ``airflow`` is first imported, so the demo sets the environment first and
refuses to run in a process that already imported it. The demo is the Airflow side's composition root (torch-free,
like every module of ``plugins/``): nothing imports it; ``rlhf demo`` runs it as its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import rlhf_airflow

DAG_ID = "rlhf_ppo"
MLFLOW_UI_PORT = 5000
AIRFLOW_UI_PORT = 8080
PG_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432"
# The demo's run: tiny-cpu answering with one token, 30 steps, a checkpoint (and its evaluation) every 10.
# Why one token: with two, the tiny model learns to copy the digit within ~25 steps but then repeats it ("77"),
# which the strict accuracy counts wrong; learning to stop takes it far more than the demo's steps, so the old
# demo's greedy accuracy stayed at 0 and pass@4 fell as the policy sharpened onto "77". Measured with one token
# (validation accuracy, 60-step run): 0.0 at step 0, 0.39 at 10, 0.91 at 20, 1.0 from 30 on.
DEMO_STEPS = 30  # checkpoints (each evaluated) at a third, two thirds and the end
DEMO_PARAMS: dict[str, Any] = {
    "eval_max_prompts": 64,
    "eval_metric": "eval/acc",
    # Keep all three checkpoints (a few MB each): the summary table reads each one's eval.json, and the
    # default retention (the last two plus the best) would drop the first one's row.
    "keep_last": 0,
    "overrides": ["rollout.max_new_tokens=1", "trainer.test_freq=10"],
}


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
    layout: dict[str, Any] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    log_file: str | None = None
    learning_curve: str | None = None
    summary: list[str] = field(default_factory=list)
    tasks: dict[str, tuple[str, float]] = field(default_factory=dict)


def dags_folder() -> Path:
    """The repository's ``dags/`` (the demo runs from a source checkout: ``plugins/rlhf_airflow/`` beside it)."""
    folder = Path(rlhf_airflow.__file__).resolve().parents[2] / "dags"
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


def _run_dag(conf: dict[str, Any], console: Any = None) -> Any:
    from airflow.dag_processing.dagbag import BundleDagBag
    from airflow.sdk.listener import get_listener_manager

    folder = dags_folder()
    bag = BundleDagBag(dag_folder=str(folder), bundle_path=folder, bundle_name="dags-folder")
    if bag.import_errors:
        raise RuntimeError(f"the DAGs folder has import errors: {bag.import_errors}")
    # The cluster pool the train and evaluate tasks name: dag.test() ignores pools, but `airflow standalone` on
    # this DB (the UI command the demo prints) schedules no task of a missing pool.
    from rlhf_airflow.pools import ensure_pools, pools_of

    ensure_pools(pools_of(bag.dags.values()))
    if console is not None:
        get_listener_manager().add_listener(console)
    return bag.dags[DAG_ID].test(run_conf=conf)


def _train_info(run_id: str) -> Any:
    from rlhf_ops.pipeline.console import train_info_from

    return train_info_from(_xcom(run_id, "preflight", "layout"), _xcom(run_id, "preflight", "config"))


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
    from rlhf_ops.pipeline.local_stack import ensure_postgres_databases, start_mlflow_server

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
        steps: Training steps (None: ``DEMO_STEPS``); three checkpoints, each evaluated.
        echo: Where progress lines go.
    """
    from rlhf_ops.pipeline.console import PipelineConsole
    from rlhf_ops.pipeline.local_stack import start_ray_head

    if "airflow" in sys.modules:
        raise RuntimeError("run the demo in a fresh process: airflow was already imported with other settings")
    start, root = time.monotonic(), root.absolute()
    env = airflow_env(root, postgres=postgres)
    os.environ.update(env)
    _write_env_file(root / "airflow" / "env.sh", env)
    log_file = root / "logs" / f"demo-{time.strftime('%Y%m%dT%H%M%S')}.log"
    echo(f"[demo] full logs: {log_file}")
    with captured_output(log_file) as terminal:
        say = echo if echo is not print else (lambda line: print(line, file=terminal, flush=True))
        say(f"[demo] Airflow home {env['AIRFLOW_HOME']} ({'PostgreSQL' if postgres else 'SQLite'}); migrating")
        mlflow, backend = _mlflow_start(root, postgres=postgres)
        ray = None
        try:
            _migrate()
            ray = start_ray_head(root / "logs", num_cpus=2)
            say(f"[demo] MLflow {mlflow.url}, Ray {ray.url}; running {DAG_ID} (tiny-cpu):")
            os.environ.update(_connections(mlflow_url=mlflow.url, ray_url=ray.url))
            conf: dict[str, Any] = {
                "preset": "tiny-cpu",
                "work_dir": str(root / "work"),
                "remote_store_url": (root / "remote").as_uri(),
                "ray_address": ray.url,
                **DEMO_PARAMS,
            }
            run_steps = steps or DEMO_STEPS
            conf.update(total_training_steps=run_steps, save_freq=max(1, run_steps // 3))
            console = PipelineConsole(terminal, tty=terminal.isatty(), train_info=_train_info)
            dag_run = _run_dag(conf, console)
            result = _collect(dag_run, start=start)
            result.tasks = {f"{k[0]}[{k[1]}]" if k[1] >= 0 else k[0]: v for k, v in console.ended.items()}
            _summarise(result, mlflow_url=mlflow.url)
        finally:
            if ray is not None:
                ray.stop()
            mlflow.stop()
    result.log_file = str(log_file)
    result.commands = _ui_commands(root, backend=backend)
    _report(result, echo)
    return result


@contextlib.contextmanager
def captured_output(log_file: Path) -> Iterator[TextIO]:
    """Send everything written to fds 1 and 2 (Airflow's, Ray's and MLflow's log records) to ``log_file``.

    Yields a text stream on the original stdout for the lines meant for the person at the terminal.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = os.fdopen(os.dup(saved[1]), "w", buffering=1)
    with log_file.open("ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield terminal
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            terminal.close()


def _summarise(result: DemoResult, *, mlflow_url: str) -> None:
    """The summary table and the learning curve (in the run folder, and logged to the MLflow run)."""
    from rlhf_ops.pipeline.checkpoints import collect_eval_reports
    from rlhf_ops.pipeline.layout import RunLayout
    from rlhf_ops.pipeline.summary import (
        CURVE_FILE,
        log_curve_to_mlflow,
        plot_learning_curve,
        run_summary,
        summary_lines,
    )

    if not result.checkpoints:
        return
    layout = RunLayout.from_dict(result.layout)
    summary = run_summary(Path(result.checkpoints), collect_eval_reports(layout), result.registered)
    result.summary = summary_lines(summary)
    png = plot_learning_curve(summary, Path(result.checkpoints) / CURVE_FILE, title=f"{DAG_ID} {layout.run_key}")
    if png is not None:
        result.learning_curve = str(png)
        if result.mlflow_run_id:
            log_curve_to_mlflow(png, run_id=result.mlflow_run_id, tracking_uri=mlflow_url)


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
        layout=plan_layout,
        mlflow_run_id=_xcom(dag_run.run_id, "start_tracking", "mlflow_run_id"),
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


def _report(result: DemoResult, echo: Callable[[str], Any]) -> None:
    registered = result.registered or {}
    decision = registered.get("summary") or "no decision"
    lines = [
        "",
        f"[demo] DAG run {result.state} in {result.seconds:.0f} s",
        *result.summary,
        f"  registered:     {registered.get('registered_name')} v{registered.get('version')} "
        f"(step {registered.get('best_step')}); champion {'moved' if registered.get('promoted') else 'kept'}",
        f"  decision:       {decision}",
        f"  learning curve: {result.learning_curve}",
        f"  run folder:     {result.checkpoints}  (eval.json per checkpoint)",
        f"  remote store:   {result.remote}",
        f"  MLflow run:     {result.mlflow_run_url}",
        f"  full logs:      {result.log_file}",
        "Open the UIs (each in its own terminal):",
        f"  Airflow: {result.commands['airflow']}   then http://127.0.0.1:{AIRFLOW_UI_PORT}/dags/{DAG_ID}",
        f"  MLflow:  {result.commands['mlflow']}   then {result.mlflow_run_url}",
    ]
    for line in lines:
        echo(line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf demo", description="run the whole pipeline (Airflow + Ray + MLflow) locally on tiny-cpu"
    )
    parser.add_argument("--root", default=".rlhf", help="folder for the Airflow home, MLflow store, checkpoints")
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="Airflow's and MLflow's databases in PostgreSQL at 127.0.0.1:5432 (or RLHF_DEMO_POSTGRES=1)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 30; three checkpoints)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``rlhf demo [--root R] [--postgres] [--steps N]``: 0 when the DAG run succeeded, else 1."""
    args = build_parser().parse_args(argv)
    postgres = args.postgres or os.environ.get("RLHF_DEMO_POSTGRES", "").strip().lower() in ("1", "true", "yes")
    result = run_demo(Path(args.root), postgres=postgres, steps=args.steps)
    return 0 if result.state == "success" else 1


if __name__ == "__main__":
    raise SystemExit(main())
