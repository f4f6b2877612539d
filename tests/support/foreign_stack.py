"""Virtualenvs standing in for a platform team's own stack: an Airflow of another release with the provider wheel
installed alone, and a Ray cluster's Python holding only the library wheel.

Each venv lies under ``$RLHF_FOREIGN_VENV_CACHE/<name>-<hash>`` (default ``~/.cache/rlhf-ops/foreign-venvs``,
outside the checkout, so a fresh clone on the same machine reuses it; building one takes ~8 minutes); the hash
covers what decides its third-party contents (the requirements, the dependency tables of both pyproject files, the
constraints file, the interpreter), so a repeat only reinstalls the freshly built wheels (``--no-deps``, seconds). A
venv is used only once its ``.complete`` marker exists: an interrupted build is started over.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("RLHF_FOREIGN_VENV_CACHE", Path.home() / ".cache" / "rlhf-ops" / "foreign-venvs"))
CONSTRAINTS = ROOT / "constraints" / "ci.txt"
PYTHON = shutil.which("python3.11") or sys.executable
# The foreign Airflow: the newest 3.1.x (the oldest line with the HITL operators the approval gate uses); ours is 3.3.
FOREIGN_AIRFLOW = "3.1.8"
_PIP = ["-m", "pip", "install", "-q", "--disable-pip-version-check"]


def build_wheels(out_dir: Path) -> dict[str, Path]:
    """Both wheels, built by scripts/build_wheels.py into ``out_dir``: ``{"library": ..., "provider": ...}``."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_wheels.py"), str(out_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    library, provider = (Path(line) for line in result.stdout.split())
    return {"library": library, "provider": provider}


def _dependency_tables() -> dict[str, object]:
    tables: dict[str, object] = {}
    for name, path in (("library", ROOT / "pyproject.toml"), ("provider", ROOT / "plugins" / "pyproject.toml")):
        project = tomllib.loads(path.read_text())["project"]
        tables[name] = [project.get("dependencies"), project.get("optional-dependencies"), project["version"]]
    return tables


def venv_key(name: str, requirements: Sequence[str], *, constraints: Path | None) -> str:
    """The cache key of a venv: its name and a hash of everything that decides its third-party packages."""
    inputs = {
        "python": subprocess.run(
            [PYTHON, "-c", "import sys; print(sys.version)"], capture_output=True, text=True
        ).stdout.strip(),
        "requirements": list(requirements),
        "constraints": constraints.read_text() if constraints else None,
        "dependencies": _dependency_tables(),
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return f"{name}-{digest}"


def cached_venv(
    name: str,
    requirements: Sequence[str],
    *,
    wheels: dict[str, Path],
    reinstall: Sequence[str],
    constraints: Path | None = None,
    timeout_s: float = 1500,
) -> Path:
    """The venv ``name`` (its ``bin/python``) holding ``requirements`` and the current ``wheels``.

    ``requirements`` may name ``{library}`` / ``{provider}``, replaced by the wheel paths; ``wheels``' folder is a
    find-links source, so a requirement on ``rlhf-ops`` resolves to the built wheel. The first build installs
    from the package index (minutes); later calls only reinstall the ``reinstall`` wheels without dependencies.
    """
    venv = CACHE / venv_key(name, requirements, constraints=constraints)
    python = venv / "bin" / "python"
    links = ["--find-links", str(wheels["library"].parent)]
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([PYTHON, "-m", "venv", str(venv)], check=True, timeout=120)
        args = [req.format(**{k: str(v) for k, v in wheels.items()}) for req in requirements]
        extra = ["-c", str(constraints)] if constraints else []
        _run([str(python), *_PIP, *links, *extra, *args], timeout_s=timeout_s)
        (venv / ".complete").write_text("\n".join(args) + "\n")
    fresh = [str(wheels[key]) for key in reinstall]
    _run([str(python), *_PIP, "--no-deps", "--force-reinstall", *fresh], timeout_s=300)
    return python


def _run(cmd: list[str], *, timeout_s: float) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({result.returncode}):\n{tail}")


# The AWS chain the provider brings (the Amazon provider's hook, s3fs): without pins pip backtracks through years of
# boto3 / aiobotocore / s3fs releases (over 12 minutes). A team's own Airflow constraints file plays this part.
AWS_CHAIN = ("apache-airflow-providers-amazon", "aiobotocore", "boto3", "botocore", "s3fs", "fsspec")
# Airflow 3.1's Fernet wrapper sets an attribute on cryptography's MultiFernet, a Rust object from cryptography 51
# on: every connection with a password then reads as "isn't defined" (AttributeError 'is_encrypted', logged and
# swallowed by the secrets lookup). Airflow's own constraints file pins it for a team; the lock does here.
AIRFLOW_31_PINS = ("cryptography",)


def locked(names: Sequence[str]) -> list[str]:
    """``name==version`` for each of ``names`` from the lock file (``constraints/ci.txt``)."""
    pins = dict(line.split("==", 1) for line in CONSTRAINTS.read_text().splitlines() if "==" in line)
    return [f"{name}=={pins[name].strip()}" for name in names]


def airflow_venv(wheels: dict[str, Path]) -> Path:
    """Another Airflow 3 release, no torch, and the provider wheel installed alone (it pulls the library core)."""
    requirements = [f"apache-airflow=={FOREIGN_AIRFLOW}", "{provider}", *locked(AWS_CHAIN), *locked(AIRFLOW_31_PINS)]
    return cached_venv("airflow", requirements, wheels=wheels, reinstall=("library", "provider"))


def ray_venv(wheels: dict[str, Path]) -> Path:
    """A Ray cluster's Python: the library wheel with its training extra, at the versions CI ran, no Airflow."""
    return cached_venv("ray", ["{library}[train]"], wheels=wheels, reinstall=("library",), constraints=CONSTRAINTS)
