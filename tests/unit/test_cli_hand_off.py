"""``rlhf train``, ``rlhf sft`` and ``rlhf demo`` hand the process to the composition roots by module path.

The library's CLI imports neither ``workers/`` nor Airflow (the import-linter contracts hold that); these tests
check the other half: the module paths it runs exist, every argument (``--help`` included) reaches the
module's own parser, and the demo's module imports without Airflow or torch (it sets Airflow's environment
before importing it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_ops.cli import HANDED_OFF

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}


def _rlhf(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rlhf_ops.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("command", sorted(HANDED_OFF))
def test_each_handed_off_command_names_a_module_that_exists(command: str) -> None:
    module = HANDED_OFF[command][0]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    assert Path(spec.origin).resolve().is_relative_to(ROOT), (module, spec.origin)


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("train", "usage: rlhf train [-h] [--preset PRESET] [--ray-address RAY_ADDRESS]"),
        ("demo", "usage: rlhf demo [-h] [--root ROOT] [--postgres] [--steps STEPS]"),
        ("sft", "usage: rlhf sft [-h] [--preset PRESET]"),
    ],
)
def test_help_reaches_the_module_s_own_parser(command: str, usage: str) -> None:
    done = _rlhf(command, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(usage), done.stdout


def test_a_bad_option_is_refused_by_the_module_with_exit_code_2() -> None:
    done = _rlhf("demo", "--stepz", "3")
    assert done.returncode == 2 and "unrecognized arguments: --stepz 3" in done.stderr, done.stderr


def test_the_demo_module_imports_without_airflow_or_torch() -> None:
    code = "import sys, rlhf_airflow.demo; print(sorted(m for m in ('airflow', 'torch') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-2000:]
