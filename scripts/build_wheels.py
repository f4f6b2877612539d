"""Build the two wheels of this repository: the library ``rlhf-ops`` and the provider ``airflow-provider-rlhf``.

Each is built from a copy of its sources (never in place: setuptools would leave ``build/`` folders in
``plugins/``, which Airflow's plugins folder would then import), without build isolation, so no network is
needed where setuptools and wheel are installed. The wheels are reproducible (every file dated SOURCE_DATE_EPOCH,
1980-01-01 unless set): the same sources give the same bytes, so an image built from them is reused as is.

Usage: python scripts/build_wheels.py [OUT_DIR]   (default: dist/; prints the two wheel paths)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The earliest date a zip file can hold; a fixed date makes the wheel's bytes depend on its contents only.
_EPOCH = "315532800"
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", ".mypy_cache", ".pytest_cache")
# distribution: (source folder, what of it the wheel is built from)
SOURCES = {
    "rlhf-ops": (ROOT, ("pyproject.toml", "README.md", "rlhf_ops", "workers")),
    "airflow-provider-rlhf": (ROOT / "plugins", ("pyproject.toml", "rlhf_airflow")),
}


def build(out_dir: Path) -> list[Path]:
    """Build both wheels into ``out_dir`` (older wheels of the same names are replaced); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    wheels: list[Path] = []
    for name, (source, parts) in SOURCES.items():
        stem = name.replace("-", "_")
        for old in out_dir.glob(f"{stem}-*.whl"):
            old.unlink()
        with tempfile.TemporaryDirectory(prefix=f"wheel-{stem}-") as tmp:
            for part in parts:
                src, dst = source / part, Path(tmp) / part
                if src.is_dir():
                    shutil.copytree(src, dst, ignore=_SKIP)
                else:
                    shutil.copy2(src, dst)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "-q",
                    "--no-deps",
                    "--no-build-isolation",
                    "-w",
                    str(out_dir),
                    tmp,
                ],
                check=True,
                env={**os.environ, "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", _EPOCH)},
            )
        found = sorted(out_dir.glob(f"{stem}-*.whl"))
        if len(found) != 1:
            raise RuntimeError(f"expected one {stem} wheel in {out_dir}, found {[p.name for p in found]}")
        wheels.append(found[0])
    return wheels


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build both wheels, print their paths."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=ROOT / "dist")
    args = parser.parse_args(argv)
    for wheel in build(args.out_dir.resolve()):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
