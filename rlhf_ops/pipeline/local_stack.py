"""The local services of the demo and the tests: a Ray head with its job server and an MLflow server,
stopped by PID. Used by ``rlhf demo`` (``rlhf_airflow.demo``) and the tests; torch-free, no Airflow.

Both bind 127.0.0.1 on free ports and run in their own session (``setsid``), so stopping them signals only
their process groups: ``ray stop`` would kill every Ray cluster of the user on a shared machine. Ray 2.60
turns token auth on by default for ``ray start``; the demo's loopback head starts with ``RAY_AUTH_MODE=disabled``
(``auth_token=...``: ``RAY_AUTH_MODE=token`` with that token; clients send ``Authorization: Bearer <token>``).
The Ray head gets this interpreter's ``bin/`` first on ``PATH``, so job entrypoints (``python -m …``) run
in the same virtualenv. PostgreSQL (``--postgres``): :func:`ensure_postgres_databases` creates the demo's
databases when they are missing (trust auth on 127.0.0.1:5432, ``psycopg2``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_RAY_PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
    "--metrics-export-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
)


@dataclass(frozen=True)
class Service:
    """A started server: its URL, its log file, and ``stop()`` (idempotent)."""

    url: str
    log: Path
    pid: int
    stop: Callable[[], None]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _venv_env(extra: dict[str, str], python: Path | None = None) -> dict[str, str]:
    env = {**os.environ, **extra}
    bin_dir = str(Path(python or sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def _kill_group(
    proc: subprocess.Popen[bytes], *, extra_pids: Callable[[], list[int]] = list, grace_s: float = 8
) -> None:
    """SIGTERM then SIGKILL the process group of ``proc`` (its session) and ``extra_pids()``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for pid in extra_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        if not extra_pids():
            return


def _session_pids(sid: int, marker: str) -> list[int]:
    """Our processes in session ``sid`` or whose command line holds ``marker`` (Ray daemons re-parent)."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != os.getuid() or proc.pid == os.getpid():
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getsid(proc.pid) == sid or marker in " ".join(proc.info["cmdline"] or []):
                pids.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return pids


def _wait_http(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout_s: float,
    *,
    want_list: bool = False,
    headers: dict[str, str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers=headers or {})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200 and (not want_list or isinstance(json.loads(resp.read() or b"[]"), list)):
                    return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")


def ray_head_ports() -> dict[str, int]:
    """Free ports for every port a Ray head opens, by ``ray start`` flag (``--port``, ``--dashboard-port``...)."""
    return dict(zip(_RAY_PORT_FLAGS, free_ports(len(_RAY_PORT_FLAGS)), strict=True))


def start_ray_head(
    log_dir: Path,
    *,
    num_cpus: int = 2,
    timeout_s: float = 180.0,
    auth_token: str | None = None,
    python: Path | None = None,
    ports: Mapping[str, int] | None = None,
) -> Service:
    """A private Ray head (dashboard + job server on 127.0.0.1); ``url`` is the dashboard URL.

    ``auth_token``: require this bearer token on the dashboard and job API (None: auth off).
    ``python``: the interpreter of the virtualenv the cluster runs (its ``ray`` CLI, and its ``python`` first on
    the jobs' PATH); default: this process's.
    ``ports``: its ports (``ray_head_ports()``), to start a head again where the last one was; default: free ones.
    """
    ports = dict(ports or ray_head_ports())
    temp_dir = tempfile.mkdtemp(prefix="rayd_", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    ray_cli = Path(python or sys.executable).with_name("ray")
    cmd = [str(ray_cli), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1"]
    cmd += [f"{flag}={port}" for flag, port in ports.items()]
    cmd += [f"--num-cpus={num_cpus}", "--include-dashboard=true", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    env = _venv_env(
        {
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "token" if auth_token else "disabled",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        },
        python,
    )
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    if auth_token:
        env["RAY_AUTH_TOKEN"] = auth_token
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "ray_head.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{ports['--dashboard-port']}"

    def stop() -> None:
        _kill_group(proc, extra_pids=lambda: _session_pids(proc.pid, temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)

    try:
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else None
        _wait_http(f"{url}/api/jobs/", proc, log, timeout_s, want_list=True, headers=headers)
    except BaseException:
        stop()
        raise
    return Service(url=url, log=log, pid=proc.pid, stop=stop)


def start_mlflow_server(
    root: Path, *, backend_store_uri: str | None = None, timeout_s: float = 120.0, port: int | None = None
) -> Service:
    """``mlflow server`` on 127.0.0.1 (one worker; SQLite under ``root`` unless ``backend_store_uri``), on ``port``
    or a free one (a server started again on its old port and ``root`` serves the same runs)."""
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_ports(1)[0]
    exe = Path(sys.executable).with_name("mlflow")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
    backend = backend_store_uri or f"sqlite:///{(root / 'mlflow.db').absolute()}"
    cmd = [
        *base,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        backend,
        "--artifacts-destination",
        (root / "artifacts").absolute().as_uri(),
    ]
    env = _venv_env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "OMP_NUM_THREADS": "1"})
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID"):
        env.pop(name, None)
    log = root / "server.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=root, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        _kill_group(proc, extra_pids=lambda: _session_pids(proc.pid, f"--port {port}"))

    try:
        _wait_http(f"{url}/health", proc, log, timeout_s)
    except BaseException:
        stop()
        raise
    return Service(url=url, log=log, pid=proc.pid, stop=stop)


def ensure_postgres_databases(
    names: Sequence[str], *, host: str = "127.0.0.1", port: int = 5432, user: str = "postgres"
) -> None:
    """Create each database in ``names`` that does not exist yet (trust auth; needs ``psycopg2``).

    Raises:
        RuntimeError: no PostgreSQL driver, or the server is unreachable.
    """
    try:
        import psycopg2
    except ImportError:
        raise RuntimeError(
            "--postgres needs a PostgreSQL driver for Airflow and MLflow: pip install psycopg2-binary"
        ) from None
    for name in names:
        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r} must be letters, digits and underscores")
    try:
        conn = psycopg2.connect(host=host, port=port, user=user, dbname="postgres", connect_timeout=10)
    except psycopg2.OperationalError as exc:
        raise RuntimeError(f"cannot reach PostgreSQL at {host}:{port} as {user}: {exc}") from exc
    conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    try:
        with conn.cursor() as cur:
            for name in names:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{name}"')
    finally:
        conn.close()
