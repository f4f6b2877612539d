"""A real ``mlflow server`` for tests, as a context manager over the demo's own starter
(:func:`rlhf_ops.pipeline.local_stack.start_mlflow_server`: SQLite backend, proxied file artifacts,
127.0.0.1 on a free port, its own process group, stopped by PID)::

    with mlflow_server() as tracking_uri:
        client = MlflowClient(tracking_uri)
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rlhf_ops.pipeline.local_stack import start_mlflow_server


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
