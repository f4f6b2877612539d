"""A real ``mlflow server`` for tests: SQLite backend, proxied file artifacts, 127.0.0.1 on a free port.

Use as a context manager (the lead wires it into ``tests/conftest.py`` as a session fixture)::

    with mlflow_server() as tracking_uri:
        client = MlflowClient(tracking_uri)

The server runs in its own process group (uvicorn forks a worker), so teardown signals the group:
SIGTERM, then SIGKILL after a grace period. Job execution (MLflow 3's background job runner) is off
to keep the server to one light process tree on a shared 2-core machine.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mlflow_command(port: int, root: Path) -> list[str]:
    exe = Path(sys.executable).with_name("mlflow")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
    return [
        *base,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        (root / "artifacts").as_uri(),
    ]


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop the server's process group by PID: SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # start_new_session=True made pid the group id
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # leftover uvicorn workers in the group
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.wait(timeout=5)


def _log_tail(log_path: Path, n: int = 40) -> str:
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    return "\n".join(lines[-n:])


@contextlib.contextmanager
def mlflow_server(*, root: Path | None = None, startup_timeout_s: float = 90.0) -> Iterator[str]:
    """Start ``mlflow server`` and yield its tracking URI (``http://127.0.0.1:<port>``).

    Args:
        root: Folder for ``mlflow.db``, ``artifacts/`` and ``server.log``; a temporary one (removed
            afterwards) when ``None``.
        startup_timeout_s: How long to wait for ``/health``; the log tail is in the error.
    """
    own_root = root is None
    work = Path(tempfile.mkdtemp(prefix="mlflow-server-")) if root is None else root
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "OMP_NUM_THREADS": "1"}
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID"):
        env.pop(name, None)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _mlflow_command(port, work),
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(uri):
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{_log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not healthy after {startup_timeout_s}s:\n{_log_tail(log_path)}")
            time.sleep(0.25)
        yield uri
    finally:
        _stop(proc)
        if own_root:
            shutil.rmtree(work, ignore_errors=True)
