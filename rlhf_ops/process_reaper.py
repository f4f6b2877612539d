"""Nothing of a killed run stays alive: a watchdog that SIGKILLs every process the run started once it dies.

``rlhf train`` with a local Ray cluster starts GCS, raylet, agents and one worker process per rank. Ray ties
GCS and raylet to the driver (``PR_SET_PDEATHSIG``), but the raylet puts each worker in a process group of its
own, so a SIGKILL of the driver's process group (a lost node, an OOM killer, ``kill -9 -PGID``) leaves the
workers running until they notice the raylet is gone: measured 0.5-2.6 s here, longer under load, holding
their memory (a vLLM engine, FSDP shards) meanwhile.

:func:`start_run_reaper` marks the driver's environment with a random token that every process it starts
inherits (the raylet and, through it, the workers), then starts a small watchdog in a session of its own
whose stdin is a pipe from the driver. When the driver dies by any means, the pipe closes; the watchdog kills
every process whose initial environment holds the token (``/proc/<pid>/environ``, same user only), repeats
until none is left (at most ``REAP_WINDOW_S``), and exits. Processes that do not carry the token (a shared
Ray cluster's workers, the user's shell) are never touched. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REAP_ENV = "RLHF_RUN_REAP_TOKEN"
REAP_WINDOW_S = 10.0
_PROC = Path("/proc")


def processes_with_token(token: str) -> list[int]:
    """PIDs (not this process) whose initial environment holds ``REAP_ENV=token``."""
    needle = f"{REAP_ENV}={token}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:  # gone, or another user's process
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def reap(token: str, *, window_s: float = REAP_WINDOW_S) -> int:
    """SIGKILLs every process carrying ``token`` until none is left or ``window_s`` passed; returns how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        pids = processes_with_token(token)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return len(killed)


def start_run_reaper() -> str | None:
    """Marks this process's environment and starts the watchdog; returns the token (None where unsupported).

    Call it before the run starts any process (``ray.init`` of a local cluster); idempotent per process.
    """
    if not sys.platform.startswith("linux") or not _PROC.is_dir():
        return None
    if _WATCHDOGS and os.environ.get(REAP_ENV):  # this process has its watchdog (a token inherited from a
        return os.environ[REAP_ENV]  # parent process is replaced: the parent's watchdog does not watch us)
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != REAP_ENV}  # the watchdog must not match itself
    # The write end of the pipe stays in this process (never inherited by Ray: subprocess closes other fds).
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "rlhf_ops.process_reaper", token, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # a kill of the run's process group or session does not reach it
    )
    _WATCHDOGS.append(watchdog)  # keeps the pipe open for the life of this process
    os.environ[REAP_ENV] = token
    return token


_WATCHDOGS: list[subprocess.Popen[bytes]] = []


def _alive(pid: int) -> bool:
    try:
        state = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _watch(token: str, driver: int) -> int:
    import select

    # EOF on stdin: the driver exited or was killed. The pid check covers a forked child of the driver that
    # inherited the pipe's write end (fork copies descriptors) and keeps it open.
    while _alive(driver):
        ready, _, _ = select.select([sys.stdin.buffer], [], [], 0.2)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    reap(token)
    return 0


if __name__ == "__main__":
    raise SystemExit(_watch(sys.argv[1], int(sys.argv[2])))
