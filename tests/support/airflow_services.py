"""A real Airflow 3 deployment for tests: api-server, scheduler, dag-processor and triggerer on 127.0.0.1.

``airflow standalone`` hangs on shutdown, so each component is its own ``airflow <component>`` subprocess in
its own session (``setsid``), with the LocalExecutor and the metadata DB in PostgreSQL (a fresh database per
test session, dropped at the end: :func:`postgres_database`). Stopping signals each component's process group
and every descendant found at that moment by PID (task processes put themselves in their own process group),
SIGTERM then SIGKILL after a grace period: never by name.

Settings every component must share are explicit: the JWT secret (the execution API's task tokens and the
REST API's tokens), the API secret key, the Fernet key, the execution API URL (Airflow defaults it to
``http://localhost:8080``) and the simple auth manager's users with a pre-written passwords file, so the test
knows the password. The scheduler and the triggerer run with ``--skip-serve-logs``: their log servers bind all
interfaces; the api-server reads task logs from the shared local log folder instead.

Use it as a context manager::

    with postgres_database() as db, airflow_services(home, db_url=db.url, dags_folder=..., plugins_folder=...) as af:
        token = af.token()
        status, body = af.request("GET", "/api/v2/dags", token=token)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from rlhf_ops.pipeline.local_stack import free_ports

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
_HEALTH_PARTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")  # GET /api/v2/monitor/health
USERNAME = "admin"
# The pipelines' default cluster pool (plugins/rlhf_airflow/pools.py): the scheduler runs no task of a missing pool.
CLUSTER_POOLS = {"rlhf_cluster": 4}
PG_HOST, PG_PORT, PG_USER = "127.0.0.1", 5432, "postgres"


@dataclass(frozen=True, kw_only=True)
class PostgresDatabase:
    """A database on the local PostgreSQL server; ``url`` is the SQLAlchemy URL Airflow wants."""

    name: str
    host: str = PG_HOST
    port: int = PG_PORT
    user: str = PG_USER

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://{self.user}@{self.host}:{self.port}/{self.name}"


def _pg_admin(host: str, port: int, user: str) -> Any:
    import psycopg2

    conn = psycopg2.connect(host=host, port=port, user=user, dbname="postgres", connect_timeout=5)
    conn.autocommit = True  # CREATE / DROP DATABASE cannot run inside a transaction
    return conn


def postgres_unavailable_reason(*, host: str = PG_HOST, port: int = PG_PORT, user: str = PG_USER) -> str | None:
    """Why a test database cannot be created here (no driver, no server), or None when it can."""
    try:
        import psycopg2
    except ImportError:
        return "psycopg2 is not installed: pip install psycopg2-binary"
    try:
        _pg_admin(host, port, user).close()
    except psycopg2.OperationalError as exc:
        return f"PostgreSQL at {host}:{port} (user {user}) is unreachable: {str(exc).strip()}"
    return None


@contextlib.contextmanager
def postgres_database(
    prefix: str = "rlhf_airflow_test", *, host: str = PG_HOST, port: int = PG_PORT, user: str = PG_USER
) -> Iterator[PostgresDatabase]:
    """Create ``<prefix>_<pid>_<random>`` (trust auth) and drop it on exit, even with sessions still open."""
    db = PostgresDatabase(name=f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}", host=host, port=port, user=user)
    conn = _pg_admin(host, port, user)
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{db.name}"')
    finally:
        conn.close()
    try:
        yield db
    finally:
        conn = _pg_admin(host, port, user)
        try:
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{db.name}" WITH (FORCE)')  # PostgreSQL >= 13
        finally:
            conn.close()


def component_env(
    home: Path,
    *,
    db_url: str,
    dags_folder: Path,
    plugins_folder: Path,
    port: int,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment shared by ``airflow db migrate`` and the four components (inherited ``AIRFLOW*`` dropped)."""
    from cryptography.fernet import Fernet

    base = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_RLHF_"))}
    bin_dir = str(Path(sys.executable).parent)
    url = f"http://127.0.0.1:{port}"
    auth = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
    return {
        **base,
        "PATH": bin_dir + os.pathsep + base.get("PATH", ""),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins_folder),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",  # LocalExecutor worker processes: 2 cores
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        "AIRFLOW__CORE__AUTH_MANAGER": auth,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": url,
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "300",  # the files do not change during a test
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        **(extra or {}),
    }


@dataclass(kw_only=True)
class AirflowServices:
    """The running components; ``request`` talks to the REST API, ``stop()`` ends them (idempotent)."""

    base_url: str
    home: Path
    env: dict[str, str]
    password: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    username: str = USERNAME

    def log_tail(self, component: str, n: int = 60) -> str:
        """Last ``n`` lines of a component's stdout/stderr log."""
        log = self.home / "logs" / f"{component}.out"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return "\n".join(lines[-n:])

    def token(self) -> str:
        """A JWT for the REST API from the simple auth manager (``POST /auth/token``)."""
        body = {"username": self.username, "password": self.password}
        resp = requests.post(f"{self.base_url}/auth/token", json=body, timeout=30)
        if resp.status_code != 201:
            raise RuntimeError(f"POST /auth/token answered {resp.status_code}: {resp.text[:500]}")
        return str(resp.json()["access_token"])

    def request(
        self, method: str, path: str, *, token: str, body: Any = None, timeout_s: float = 60.0
    ) -> tuple[int, Any]:
        """``(status, decoded JSON body or text)`` of one REST call."""
        headers = {"Authorization": f"Bearer {token}"}
        resp = requests.request(method, f"{self.base_url}{path}", json=body, headers=headers, timeout=timeout_s)
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    def health(self) -> dict[str, Any]:
        """``GET /api/v2/monitor/health`` (no auth): metadatabase, scheduler, triggerer, dag_processor."""
        resp = requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=10)
        resp.raise_for_status()
        return dict(resp.json())

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM each component's group and descendants, SIGKILL what is left after ``grace_s``."""
        procs = [self.procs.pop(name) for name in reversed(COMPONENTS) if name in self.procs]
        # psutil.Process remembers each process's start time, so a PID reused meanwhile is never signalled.
        tree: list[psutil.Process] = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                parent = psutil.Process(proc.pid)
                tree += [parent, *parent.children(recursive=True)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                if proc.poll() is None:  # not reaped yet: its pid, the group id, cannot have been reused
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, sig)  # start_new_session=True: the pid is the group id
            for member in tree:
                with contextlib.suppress(psutil.Error):
                    member.send_signal(sig)  # task processes sit in process groups of their own
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _alive(tree, procs):
                time.sleep(0.3)
            if not _alive(tree, procs):
                break
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _alive(tree: list[psutil.Process], procs: list[subprocess.Popen[bytes]]) -> bool:
    for proc in procs:
        proc.poll()  # reap our direct children so they do not count as alive zombies
    for member in tree:
        with contextlib.suppress(psutil.Error):
            if member.is_running() and member.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def migrate(env: Mapping[str, str], *, timeout_s: float = 300.0) -> float:
    """``airflow db migrate`` with ``env``; returns the seconds it took."""
    start = time.monotonic()
    cli = Path(sys.executable).with_name("airflow")
    done = subprocess.run(
        [str(cli), "db", "migrate"], env=dict(env), capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"airflow db migrate failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return time.monotonic() - start


def create_pools(env: Mapping[str, str], pools: Mapping[str, int], *, timeout_s: float = 120.0) -> None:
    """``airflow pools set NAME SLOTS ... --include-deferred`` for each pool, as a deployer creates them."""
    cli = Path(sys.executable).with_name("airflow")
    for name, slots in pools.items():
        args = [str(cli), "pools", "set", name, str(slots), "RLHF cluster capacity (test)", "--include-deferred"]
        done = subprocess.run(args, env=dict(env), capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"airflow pools set {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _launch(services: AirflowServices, component: str) -> None:
    cli = Path(sys.executable).with_name("airflow")
    args = [str(cli), component]
    if component in ("scheduler", "triggerer"):
        args.append("--skip-serve-logs")  # their log servers would listen on every interface
    if component == "api-server":
        args += ["--host", "127.0.0.1", "--port", services.env["AIRFLOW__API__PORT"], "--workers", "1"]
    log = services.home / "logs" / f"{component}.out"
    with log.open("wb") as out:
        services.procs[component] = subprocess.Popen(
            args, env=services.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=services.home
        )


def _wait_healthy(services: AirflowServices, timeout_s: float) -> None:
    """Until the API answers and reports a healthy DB, scheduler, triggerer and dag-processor."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        for name, proc in services.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"airflow {name} exited with {proc.returncode}:\n{services.log_tail(name)}")
        try:
            health = services.health()
            last = json.dumps(health)
            if all(health.get(part, {}).get("status") == "healthy" for part in _HEALTH_PARTS):
                return
        except (requests.RequestException, ValueError) as exc:
            last = repr(exc)
        time.sleep(1.0)
    tails = "\n".join(f"--- {name}\n{services.log_tail(name, 20)}" for name in services.procs)
    raise TimeoutError(f"Airflow not healthy after {timeout_s:.0f}s (last: {last}):\n{tails}")


def start_airflow_services(
    home: Path,
    *,
    db_url: str,
    dags_folder: Path,
    plugins_folder: Path,
    extra_env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 240.0,
    pools: Mapping[str, int] = CLUSTER_POOLS,
) -> AirflowServices:
    """Migrate the DB, start the four components on a free port, wait until all are healthy.

    Args:
        home: ``AIRFLOW_HOME`` (config, logs, the passwords file); created if missing.
        db_url: SQLAlchemy URL of an empty (or migrated) metadata DB, e.g. ``PostgresDatabase.url``.
        dags_folder: The DAGs folder (the dag-processor parses it; the scheduler runs its tasks).
        plugins_folder: The plugins folder (operator extra links).
        extra_env: More environment for every component and task (connections as ``AIRFLOW_CONN_*``...).
        startup_timeout_s: How long the components get to report healthy.
        pools: ``{name: slots}`` created after the migration (default: the pipelines' cluster pool).

    Returns:
        The running services; call ``stop()`` (``airflow_services`` does it for you).
    """
    (home / "logs").mkdir(parents=True, exist_ok=True)
    port = free_ports(1)[0]
    env = component_env(
        home, db_url=db_url, dags_folder=dags_folder, plugins_folder=plugins_folder, port=port, extra=extra_env
    )
    password = secrets.token_urlsafe(12)
    (home / "passwords.json").write_text(json.dumps({USERNAME: password}) + "\n")
    services = AirflowServices(base_url=f"http://127.0.0.1:{port}", home=home, env=env, password=password)
    migrate(env)
    create_pools(env, pools)
    try:
        for component in COMPONENTS:
            _launch(services, component)
        _wait_healthy(services, startup_timeout_s)
    except BaseException:
        services.stop(grace_s=5.0)
        raise
    return services


@contextlib.contextmanager
def airflow_services(
    home: Path,
    *,
    db_url: str,
    dags_folder: Path,
    plugins_folder: Path,
    extra_env: Mapping[str, str] | None = None,
    startup_timeout_s: float = 240.0,
    pools: Mapping[str, int] = CLUSTER_POOLS,
) -> Iterator[AirflowServices]:
    """:func:`start_airflow_services` as a context manager that stops the components on exit."""
    services = start_airflow_services(
        home,
        db_url=db_url,
        dags_folder=dags_folder,
        plugins_folder=plugins_folder,
        extra_env=extra_env,
        startup_timeout_s=startup_timeout_s,
        pools=pools,
    )
    try:
        yield services
    finally:
        services.stop()
