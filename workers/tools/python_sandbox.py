"""The built-in ``python`` tool: runs model-written code in a separate, limited Python process.

Each call starts ``python -I -S`` (isolated: no user site, no ``PYTHON*`` variables, no ``site``) in a fresh
temporary folder with an empty environment. A trusted bootstrap runs first and, before the model's code:
- sets ``resource`` limits: CPU seconds, address space (memory), file size, open files, no core dumps;
- installs an audit hook (``sys.addaudithook``, which code cannot remove) that refuses sockets, process
  creation (``subprocess``, ``os.system``, ``exec*``, ``fork``, ``posix_spawn``), ``ctypes``, and any file
  open or file-system change whose path is outside the temporary folder (reads of the standard library
  stay allowed, so ``import math`` works).
The parent kills the process at the wall-clock limit and cuts its output. Limits: audit hooks are defence
in depth inside one interpreter, not a kernel boundary; production deployments with untrusted models
should also run workers in a container without network (docs/multi_turn.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
from typing import Any

from rlhf_ops.agent.tools import SampleState, ToolError, ToolLimits, function_schema

_BOOTSTRAP = r"""
import sys


def _sandbox(argv):
    # Everything the hook reads lives in this closure, out of reach of the model's code (no globals to patch).
    import os, resource

    root = os.path.realpath(os.getcwd())
    readable = tuple(os.path.realpath(p) for p in argv[4:] if p)
    cpu, mem, fsize = int(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    deny = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
            "os.forkpty", "os.kill", "os.killpg", "ctypes.", "pty.", "sys.remote_exec", "webbrowser.", "gc.",
            "sys._current_frames", "sys.settrace", "sys.setprofile", "resource.setrlimit",
            "os.putenv", "os.unsetenv", "urllib.Request", "http.client.connect", "ftplib.", "smtplib.")
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "os.listdir", "os.scandir", "os.chdir", "shutil.rmtree",
                   "shutil.copyfile", "shutil.move", "shutil.copytree", "os.chflags", "os.setxattr",
                   "os.removexattr", "glob.glob"}
    list_events = {"os.listdir", "os.scandir", "glob.glob"}  # imports list package folders of the stdlib
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path, roots):
        try:
            real = os.path.realpath(os.fsdecode(path))
        except Exception:
            return False
        return any(real == r or real.startswith(r + os.sep) for r in roots)

    def hook(event, args):
        if event.startswith(deny):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args[0], args[1] or "r", args[2]
            if isinstance(path, int):
                return
            writing = any(c in str(mode) for c in "wax+") or (isinstance(flags, int) and flags & write_flags)
            if inside(path, (root,)) or (not writing and inside(path, readable)):
                return
            raise PermissionError(f"sandbox: opening {path!r} outside the sandbox folder is not allowed")
        if event in path_events:
            roots = (root, *readable) if event in list_events else (root,)
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg, roots):
                    raise PermissionError(f"sandbox: {event} on {arg!r} outside the sandbox folder is not allowed")

    code = sys.stdin.read()
    sys.addaudithook(hook)
    return code


_code = compile(_sandbox(sys.argv), "<tool>", "exec")
del _sandbox
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


class PythonSandboxTool:
    """Runs a Python snippet and returns its stdout and stderr: ``{"code": "print(2 ** 10)"}`` -> ``"1024"``.

    Args:
        limits: ``timeout_s`` is the wall-clock limit (the CPU limit is its ceiling, at least 1 s);
            ``max_output_chars`` cuts the output.
        memory_mb: Address-space limit of the process.
        max_file_bytes: Largest file the code may write inside its folder.
    """

    name = "python"

    def __init__(
        self, limits: ToolLimits | None = None, *, memory_mb: int = 512, max_file_bytes: int = 1 << 20
    ) -> None:
        self.limits = limits or ToolLimits()
        self.memory_mb = memory_mb
        self.max_file_bytes = max_file_bytes
        paths = sysconfig.get_paths()
        self._stdlib = [paths["stdlib"], paths["platstdlib"], os.path.dirname(sys.executable)]

    def schema(self) -> dict[str, Any]:
        """The function schema shown to the model."""
        return function_schema(
            self.name,
            "Run a short Python 3 program (standard library only, no network, no files outside its folder) and "
            "return what it prints.",
            {"code": {"type": "string", "description": "the program; print() the result"}},
            ["code"],
        )

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        """Output of the program (stdout, then stderr); a time-out or a crash is reported in the text.

        Raises:
            ToolError: when ``code`` is missing, or the program ran past its time limit.
        """
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError("python needs a string argument 'code'")
        cpu = max(1, int(self.limits.timeout_s + 0.999))
        limits = [str(cpu), str(self.memory_mb << 20), str(self.max_file_bytes)]
        with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-") as folder:
            try:
                done = subprocess.run(
                    [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, *limits, *self._stdlib],
                    input=code,
                    capture_output=True,
                    text=True,
                    cwd=folder,
                    env={},
                    timeout=self.limits.timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as err:
                state.tool_timeouts += 1  # counted here: run_tool sees a ToolError, not its own timeout
                raise ToolError(f"the program ran past {self.limits.timeout_s:g} s and was stopped") from err
        if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            # The CPU ceiling (RLIMIT_CPU = the wall limit, rounded up) fired first: a busy loop on an idle core
            # uses CPU as fast as wall time, so this race is the same time limit, reported the same way.
            state.tool_timeouts += 1
            raise ToolError(f"the program ran past {self.limits.timeout_s:g} s and was stopped")
        out = (done.stdout + done.stderr).strip()
        limit = self.limits.max_output_chars
        if len(out) > limit:
            out = out[:limit] + f"\n[output cut at {limit} characters]"
        if done.returncode != 0 and not out:
            out = f"the program exited with status {done.returncode}"
        return out or "(no output)"
