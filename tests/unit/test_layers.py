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
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROOTS = {"workers.entrypoints", "rlhf_airflow.demo"}  # the composition roots: nothing imports them


def _contract(contract_id: str) -> dict[str, Any]:
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


def _parts(package: str, folder: Path) -> set[str]:
    return {
        f"{package}.{p.stem}"
        for p in folder.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }


def test_the_whole_library_is_barred_from_the_layers_above() -> None:
    # No part of rlhf_ops is exempt: its CLI runs the training and the demo by module path, never by import.
    assert _contract("library")["source_modules"] == ["rlhf_ops"]
    assert not list((ROOT / "rlhf_ops").glob("entrypoints/*.py"))  # the old home of the composition root


def test_the_composition_root_contract_names_every_other_part_of_workers_and_plugins() -> None:
    # A new module of workers/ or plugins/ would otherwise escape "nothing imports the composition roots".
    parts = _parts("workers", ROOT / "workers") | _parts("rlhf_airflow", ROOT / "plugins" / "rlhf_airflow")
    assert ROOTS <= parts
    contract = _contract("composition-root")
    assert set(contract["source_modules"]) == parts - ROOTS
    assert set(contract["forbidden_modules"]) == ROOTS
