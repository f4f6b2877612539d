"""The layers of ../shared/DESIGN.md hold: ``lint-imports`` keeps every contract in ``pyproject.toml``.

import-linter reads every import statement, lazy ones inside functions included, so a back-arrow such as
``rlhf_ops`` importing ``workers`` inside a function fails here (and in ``scripts/test.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION_ROOT = {"rlhf_ops.entrypoints", "rlhf_ops.cli"}


def _contract(contract_id: str) -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (found,) = [c for c in config["contracts"] if c["id"] == contract_id]
    return dict(found)


def test_lint_imports_keeps_every_contract() -> None:
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), f"{exe} missing: pip install -e '.[dev]' (import-linter is a dev dependency)"
    path = os.pathsep.join(str(ROOT / p) for p in ("", "plugins", "dags"))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [str(exe), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_library_contract_names_every_part_of_rlhf_ops_but_the_composition_root() -> None:
    # A new subpackage of rlhf_ops would otherwise escape the "library never imports workers" contract.
    parts = {
        f"rlhf_ops.{p.stem}"
        for p in (ROOT / "rlhf_ops").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert set(_contract("library")["source_modules"]) == parts - COMPOSITION_ROOT  # type: ignore[arg-type]
    assert COMPOSITION_ROOT <= parts
