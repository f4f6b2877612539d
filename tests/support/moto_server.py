"""A real S3 endpoint for tests and benchmarks: ``python -m moto.server`` on 127.0.0.1, a free port.

The server runs in its own process (its own GIL, so benchmarks measure the client) and is stopped by
PID. ``S3_UPLOAD_PART_MIN_SIZE`` lowers moto's 5 MiB minimum multipart part size, so tests can exercise
multipart uploads with files of a few hundred KB. Credentials are moto's dummies (``testing``).

Use it from a fixture::

    @pytest.fixture(scope="module")
    def moto():
        with running_moto_server(part_min_size=64 * 1024) as server:
            yield server
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REGION = "us-east-1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def aws_env(endpoint_url: str) -> dict[str, str]:
    """Environment for s3fs/boto3 clients of this endpoint; no real AWS config or credential file is read."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class MotoServer:
    """A moto S3 server subprocess."""

    def __init__(self, *, part_min_size: int | None = None, startup_timeout_s: float = 30.0) -> None:
        self.part_min_size = part_min_size
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        """Start on a free port (retrying if another process grabbed it) and wait until it answers."""
        env = {**os.environ, "MOTO_PORT": "0"}
        if self.part_min_size is not None:
            env["S3_UPLOAD_PART_MIN_SIZE"] = str(self.part_min_size)
        for _ in range(3):
            self.port = free_port()
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
            self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return self
            self.stop()
        tail = Path(self._log.name).read_text(errors="replace")[-2000:]
        self.close_log()
        raise RuntimeError(f"moto server did not start:\n{tail}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=2) as response:
                    if response.status == 200:
                        return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Terminate the server by PID (kill after 10 s)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def close_log(self) -> None:
        """Delete the server's log file."""
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def env(self) -> dict[str, str]:
        """``aws_env`` for this server."""
        return aws_env(self.endpoint_url)

    def client(self, endpoint_url: str | None = None) -> Any:
        """A boto3 S3 client of this server (or of ``endpoint_url``, e.g. a proxy in front of it)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> str:
        """Create a bucket and return its name."""
        self.client().create_bucket(Bucket=name)
        return name


@contextlib.contextmanager
def running_moto_server(*, part_min_size: int | None = None) -> Iterator[MotoServer]:
    """A started ``MotoServer``, stopped on exit."""
    server = MotoServer(part_min_size=part_min_size)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        server.close_log()
