"""A private Ray head (dashboard + job server) for tests, stopped without touching anyone else's Ray.

``ray stop`` kills every Ray process of the user, including other engineers' clusters on a shared machine,
so :func:`start_ray_head` runs ``ray start --head --block`` in a new session (``setsid``) with its own
``--temp-dir`` and explicit free ports, and the returned ``stop`` signals only that session's process group,
then any leftover process whose command line names our temp dir (SIGTERM, grace period, SIGKILL).

Ray 2.60 turns token auth on by default for ``ray start`` (using the shared ``~/.ray/auth_token``). Here the
mode is explicit: ``auth_token=None`` starts the head with ``RAY_AUTH_MODE=disabled``; a token starts it with
``RAY_AUTH_MODE=token`` and that ``RAY_AUTH_TOKEN``, and clients must send ``Authorization: Bearer <token>``.
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
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

_PORT_FLAGS = (
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


class RayHead(NamedTuple):
    """A running test head: GCS ``address`` (host:port), ``dashboard_url`` and ``stop()``."""

    address: str
    dashboard_url: str
    stop: Callable[[], None]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago (all held open while picking)."""
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


def _our_pids(temp_dir: str, sid: int) -> list[int]:
    """PIDs in session ``sid`` or whose command line mentions ``temp_dir`` (never other users' processes)."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
                continue
            if os.getsid(proc.pid) == sid or temp_dir in " ".join(proc.info["cmdline"] or []):
                pids.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return [p for p in pids if p != os.getpid()]


def _make_stop(proc: subprocess.Popen[bytes], temp_dir: str, grace_s: float = 4.0) -> Callable[[], None]:
    sid = proc.pid  # start_new_session=True: the child is its session and process-group leader

    def stop() -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(sid, sig)
            for pid in _our_pids(temp_dir, sid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _alive(proc, temp_dir, sid):
                time.sleep(0.2)
            if not _alive(proc, temp_dir, sid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        shutil.rmtree(temp_dir, ignore_errors=True)  # Ray's session logs; the `ray start` log stays in `tmp`

    return stop


def _alive(proc: subprocess.Popen[bytes], temp_dir: str, sid: int) -> bool:
    import psutil

    proc.poll()
    live = []
    for pid in _our_pids(temp_dir, sid):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                live.append(pid)
    return bool(live)


def _wait_ready(
    dashboard_url: str, token: str | None, proc: subprocess.Popen[bytes], log: Path, timeout_s: float
) -> None:
    """Wait until the job API answers ``GET /api/jobs/`` with 200 (the job agent is up by then)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{dashboard_url}/api/jobs/", headers=headers)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200 and isinstance(json.loads(resp.read() or b"[]"), list):
                    return
        time.sleep(0.5)
    raise TimeoutError(f"Ray dashboard {dashboard_url} not ready after {timeout_s}s:\n{log.read_text()[-4000:]}")


def start_ray_head(
    tmp: Path, *, auth_token: str | None = None, num_cpus: int = 1, timeout_s: float = 120.0
) -> RayHead:
    """Start a private Ray head with dashboard and job server on 127.0.0.1.

    Args:
        tmp: Folder for the ``ray start`` log (Ray's own temp dir is a short ``/tmp/rayt_*`` path because
            its unix socket paths must stay under ~107 characters).
        auth_token: Require this bearer token on the dashboard / job API (None: auth disabled).
        num_cpus: Logical CPUs of the head.
        timeout_s: How long to wait for the job API.

    Returns:
        ``RayHead(address, dashboard_url, stop)``, a named 3-tuple.
    """
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
    temp_dir = tempfile.mkdtemp(prefix="rayt_", dir="/tmp")
    ray_cli = Path(sys.executable).with_name("ray")
    cmd = [str(ray_cli), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1"]
    cmd += [f"{flag}={port}" for flag, port in ports.items()]
    cmd += [f"--num-cpus={num_cpus}", "--include-dashboard=true", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token" if auth_token else "disabled",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)
    if auth_token:
        env["RAY_AUTH_TOKEN"] = auth_token
    log = Path(tmp) / "ray_head.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stop = _make_stop(proc, temp_dir)
    dashboard_url = f"http://127.0.0.1:{ports['--dashboard-port']}"
    try:
        _wait_ready(dashboard_url, auth_token, proc, log, timeout_s)
    except BaseException:
        stop()
        raise
    return RayHead(f"127.0.0.1:{ports['--port']}", dashboard_url, stop)
