"""Print an Airflow constraints file without the pins that contradict the platform's own requirements.

Airflow's constraints file pins every package of a release (``constraints-3.3.2/constraints-3.11.txt``) to the
version the release was tested with. The platform pins a few of the same packages (``s3fs==2026.9.0``,
``ray[default]==2.60.0``...), and pip refuses a requirement that contradicts a constraint. So the image build
drops a constraint line only where its pinned version does not satisfy the platform's requirement, and keeps
every other pin, so Airflow's own dependencies stay at their tested versions.

A package released in lockstep with others (``s3fs`` pins ``fsspec`` to its own version and ``aiobotocore`` to a
``botocore`` range) drags its family along: ``--family s3fs=fsspec,aiobotocore,botocore,boto3`` drops those pins
too whenever the ``s3fs`` pin is dropped. ``pip check`` after the install catches any clash that is left.

Usage (docker/airflow.Dockerfile)::

    python constraints_without.py constraints-3.11.txt requirements-airflow.txt \\
        --family s3fs=fsspec,aiobotocore,botocore,boto3,s3transfer > constraints.txt
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# "name==version" at the start of a constraints line (Airflow writes one exact pin per line).
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def parse_requirements(lines: Iterable[str]) -> dict[str, Requirement]:
    """Requirements by canonical name; comments, pip options (``-r``, ``-c``...) and blank lines skipped.

    Raises:
        ValueError: a line is not a valid PEP 508 requirement (the message names the line).
    """
    requirements: dict[str, Requirement] = {}
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text or text.startswith("-"):
            continue
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise ValueError(f"requirements line {number}: {text!r} is not a PEP 508 requirement ({exc})") from exc
        requirements[canonicalize_name(requirement.name)] = requirement
    return requirements


def conflicting(pins: Mapping[str, str], requirements: Mapping[str, Requirement]) -> set[str]:
    """Canonical names whose pinned version is not allowed by the requirement of the same package.

    A pin that is not a valid version counts as a conflict (pip could not honour both either).
    """
    names: set[str] = set()
    for name, requirement in requirements.items():
        if name not in pins:
            continue
        try:
            allowed = requirement.specifier.contains(Version(pins[name]), prereleases=True)
        except InvalidVersion:
            allowed = False
        if not allowed:
            names.add(name)
    return names


def constraint_pins(lines: Iterable[str]) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line."""
    return {canonicalize_name(m.group(1)): m.group(2) for line in lines if (m := _PIN.match(line))}


def filter_constraints(lines: Iterable[str], *, drop: set[str]) -> list[str]:
    """Constraint lines whose package is not in ``drop`` (comments and blank lines kept as they are)."""
    return [line for line in lines if not ((m := _PIN.match(line)) and canonicalize_name(m.group(1)) in drop)]


def parse_families(values: Sequence[str]) -> dict[str, set[str]]:
    """``["s3fs=fsspec,botocore"]`` → ``{"s3fs": {"fsspec", "botocore"}}`` (canonical names).

    Raises:
        ValueError: a value is not ``HEAD=MEMBER[,MEMBER...]``.
    """
    families: dict[str, set[str]] = {}
    for value in values:
        head, sep, members = value.partition("=")
        if not (head.strip() and sep and members.strip()):
            raise ValueError(f"--family takes HEAD=MEMBER[,MEMBER...], e.g. s3fs=fsspec,botocore; got {value!r}")
        names = {canonicalize_name(m.strip()) for m in members.split(",") if m.strip()}
        families.setdefault(canonicalize_name(head.strip()), set()).update(names)
    return families


def names_to_drop(
    pins: Mapping[str, str], requirements: Mapping[str, Requirement], families: Mapping[str, set[str]]
) -> set[str]:
    """Conflicting pins plus the families of the conflicting heads."""
    drop = conflicting(pins, requirements)
    for head in sorted(drop & families.keys()):
        drop |= families[head]
    return drop


def main(argv: Sequence[str]) -> int:
    """Entry point: prints the filtered constraints on stdout and what was dropped on stderr."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("constraints", type=Path, help="Airflow constraints file (name==version per line)")
    parser.add_argument("requirements", type=Path, help="requirements file whose pins win")
    parser.add_argument("--family", action="append", default=[], help="HEAD=MEMBER[,MEMBER...] (repeatable)")
    args = parser.parse_args(argv)
    try:
        lines = args.constraints.read_text().splitlines()
        requirements = parse_requirements(args.requirements.read_text().splitlines())
        drop = names_to_drop(constraint_pins(lines), requirements, parse_families(args.family))
    except (OSError, ValueError) as exc:
        print(f"constraints_without: error: {exc}", file=sys.stderr)
        return 2
    kept = filter_constraints(lines, drop=drop)
    print(f"constraints_without: dropped {len(lines) - len(kept)} pin(s): {sorted(drop)}", file=sys.stderr)
    sys.stdout.write("".join(f"{line}\n" for line in kept))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
