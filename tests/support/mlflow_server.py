"""A real ``mlflow server`` for tests, as a context manager over the demo's own starter
(:func:`rlhf_ops.pipeline.local_stack.start_mlflow_server`: SQLite backend, proxied file artifacts,
127.0.0.1 on a free port, its own process group, stopped by PID)::

    with mlflow_server() as tracking_uri:
        client = MlflowClient(tracking_uri)
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil

from rlhf_ops.pipeline.local_stack import Service, start_mlflow_server


@contextlib.contextmanager
def mlflow_server(*, root: Path | None = None, startup_timeout_s: float = 240.0) -> Iterator[str]:
    """Start ``mlflow server`` and yield its tracking URI (``http://127.0.0.1:<port>``).

    Args:
        root: Folder for ``mlflow.db``, ``artifacts/`` and ``server.log``; a temporary one (removed
            afterwards) when ``None``.
        startup_timeout_s: How long to wait for ``/health`` (over 90 s seen on 2 cores busy with training);
            the log tail is in the error.
    """
    work = Path(tempfile.mkdtemp(prefix="mlflow-server-")) if root is None else root
    try:
        server = start_mlflow_server(work, timeout_s=startup_timeout_s)
        try:
            yield server.url
        finally:
            server.stop()
    finally:
        if root is None:
            shutil.rmtree(work, ignore_errors=True)


class RestartableMlflowServer:
    """A real ``mlflow server`` that a test can SIGKILL and start again on the same port and stores (``root``).

    Args:
        root: Folder for ``mlflow.db``, ``artifacts/`` and ``server.log`` (kept across restarts).
        startup_timeout_s: How long each start waits for ``/health``.
    """

    def __init__(self, root: Path, *, startup_timeout_s: float = 240.0) -> None:
        self.root = root
        self.startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self._service: Service | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RestartableMlflowServer: start() it first")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start the server (on its old port after a kill); returns its URL."""
        self._service = start_mlflow_server(self.root, port=self.port, timeout_s=self.startup_timeout_s)
        self.port = int(self._service.url.rsplit(":", 1)[1])
        return self._service.url

    def kill(self) -> int:
        """SIGKILL the server and every process it started (no shutdown of any kind); returns how many."""
        if self._service is None:
            return 0
        victims = _tree(self._service.pid)
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        self._service.stop()  # reaps the killed child (nothing is left to signal)
        self._service = None
        return len(victims)

    def stop(self) -> None:
        """Stop it the polite way (idempotent)."""
        if self._service is not None:
            self._service.stop()
            self._service = None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.Error:
        return []
