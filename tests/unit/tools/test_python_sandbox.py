"""The sandboxed Python tool: it runs code, and escape attempts fail inside the sandbox process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlhf_ops.agent import SampleState, ToolError, ToolLimits, run_tool
from workers.tools.python_sandbox import PythonSandboxTool


@pytest.fixture(scope="module")
def tool() -> PythonSandboxTool:
    return PythonSandboxTool(ToolLimits(timeout_s=2.0), memory_mb=256)


def _run(tool: PythonSandboxTool, code: str) -> str:
    return tool.call({"code": code}, SampleState(index=0))


def test_runs_code_with_the_standard_library(tool: PythonSandboxTool) -> None:
    assert _run(tool, "import math, json\nprint(json.dumps([math.factorial(5)]))") == "[120]"


def test_files_inside_its_own_folder_work(tool: PythonSandboxTool) -> None:
    assert _run(tool, "open('note.txt', 'w').write('kept'); print(open('note.txt').read())") == "kept"


def test_writing_outside_its_folder_fails_inside_the_sandbox(tool: PythonSandboxTool, tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    out = _run(tool, f"open({str(target)!r}, 'w').write('x')")
    assert "PermissionError: sandbox: opening" in out and "outside the sandbox folder" in out
    out = _run(tool, f"import os; os.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))")
    assert "PermissionError" in out
    assert not target.exists()


def test_reading_files_outside_fails(tool: PythonSandboxTool) -> None:
    assert "PermissionError: sandbox: opening '/etc/passwd'" in _run(tool, "print(open('/etc/passwd').read())")
    assert "os.listdir on '/'" in _run(tool, "import os; print(os.listdir('/'))")


@pytest.mark.parametrize(
    ("code", "event"),
    [
        ("import socket; socket.socket()", "socket.__new__"),
        ("import socket; socket.create_connection(('127.0.0.1', 80))", "socket."),
        ("import subprocess; subprocess.run(['true'])", "subprocess.Popen"),
        ("import os; os.system('true')", "os.system"),
        ("import ctypes; ctypes.CDLL(None)", "ctypes."),
        ("import gc; gc.get_objects()", "gc.get_objects"),
    ],
)
def test_network_processes_and_introspection_are_refused(tool: PythonSandboxTool, code: str, event: str) -> None:
    out = _run(tool, code)
    assert f"PermissionError: sandbox: {event}" in out


def test_memory_limit(tool: PythonSandboxTool) -> None:
    assert "MemoryError" in _run(tool, "x = bytearray(512 * 1024 * 1024)")


def test_time_limit_is_a_counted_timeout_observation(tool: PythonSandboxTool) -> None:
    state = SampleState(index=0)
    started = time.perf_counter()
    text = run_tool({"python": tool}, "python", {"code": "while True: pass"}, state, ToolLimits(timeout_s=2.0))
    assert time.perf_counter() - started < 3.5
    assert text == "Error: the program ran past 2 s and was stopped"
    assert (state.tool_errors, state.tool_timeouts) == (1, 1)


def test_environment_is_empty_and_output_is_cut(tool: PythonSandboxTool) -> None:
    os.environ.setdefault("RLHF_SANDBOX_SECRET_PROBE", "x")
    assert _run(tool, "import os; print(sorted(os.environ))") in ("[]", "['LC_CTYPE']")
    out = PythonSandboxTool(ToolLimits(timeout_s=2.0, max_output_chars=10)).call(
        {"code": "print('a' * 50)"}, SampleState(index=0)
    )
    assert out == "a" * 10 + "\n[output cut at 10 characters]"
    with pytest.raises(ToolError, match="'code'"):
        tool.call({}, SampleState(index=0))
