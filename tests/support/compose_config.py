"""``docker compose config`` for machines without Compose: render and validate a compose file in Python.

The development machines have the ``docker`` CLI without its compose plugin, and podman without
podman-compose, so the default test suite checks ``docker/compose.yaml`` the way ``docker compose config``
does, on the YAML level:

- YAML anchors and ``<<`` merge keys are resolved (PyYAML's safe loader);
- every ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` / ``${VAR-default}`` / ``${VAR:?error}`` /
  ``${VAR?error}`` / ``${VAR:+alternative}`` is interpolated from an env file, ``$$`` becomes ``$``; a
  required variable without a value fails like Compose (``required variable X is missing a value: ...``);
- the model is checked: known top-level and service keys, an image or a build for every service, build
  contexts and Dockerfiles and bind-mount sources that exist, named volumes that are declared,
  ``depends_on`` targets and conditions, port and duration syntax.

It covers the subset of the Compose specification the project's file uses, and says so
(:class:`ComposeError`) when it meets anything else, rather than passing it unchecked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

TOP_LEVEL_KEYS = frozenset({"name", "services", "volumes", "networks", "secrets", "configs", "include"})
SERVICE_KEYS = frozenset(
    {
        "build",
        "command",
        "depends_on",
        "deploy",
        "entrypoint",
        "environment",
        "env_file",
        "healthcheck",
        "image",
        "ports",
        "restart",
        "shm_size",
        "ulimits",
        "user",
        "volumes",
        "working_dir",
    }
)
BUILD_KEYS = frozenset({"context", "dockerfile", "args", "target"})
HEALTHCHECK_KEYS = frozenset({"test", "interval", "timeout", "retries", "start_period", "disable"})
DEPENDS_CONDITIONS = frozenset({"service_started", "service_healthy", "service_completed_successfully"})
RESTART_POLICIES = frozenset({"no", "always", "on-failure", "unless-stopped"})
_DURATION = re.compile(r"^(\d+(\.\d+)?(us|ms|s|m|h))+$")
_PORT = re.compile(r"^(?:(?P<ip>[0-9.]+):)?(?:(?P<host>\d+):)?(?P<container>\d+)(?:/(?:tcp|udp))?$")
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|(?P<plain>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<braced>[^}]*)\})")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


class ComposeError(ValueError):
    """The compose file does not render or does not validate; the message says where and why."""


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of a compose env file (comments and blank lines skipped, no quoting rules needed)."""
    env: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "=" not in stripped:
            raise ComposeError(f"{path.name}:{number}: not a KEY=value line: {stripped!r}")
        key, value = stripped.split("=", 1)
        env[key.strip()] = value
    return env


def interpolate(value: str, env: Mapping[str, str], where: str) -> str:
    """One string with Compose's variable syntax substituted from ``env``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group("escaped"):
            return "$"
        if match.group("plain"):
            return env.get(match.group("plain"), "")
        braced = _BRACED.match(match.group("braced"))
        if braced is None or "$" in (braced.group("arg") or ""):
            raise ComposeError(f"{where}: unsupported variable syntax ${{{match.group('braced')}}}")
        name, op, arg = braced.group("name"), braced.group("op"), braced.group("arg") or ""
        current = env.get(name)
        set_and_not_empty = bool(current)
        if op is None:
            return current or ""
        if op in (":-", "-"):
            return current if (set_and_not_empty if op == ":-" else current is not None) else arg  # type: ignore[return-value]
        if op in (":?", "?"):
            if (op == ":?" and not set_and_not_empty) or current is None:
                raise ComposeError(f"required variable {name} is missing a value: {arg}")
            return current
        return arg if (set_and_not_empty if op == ":+" else current is not None) else ""

    return _VAR.sub(substitute, value)


def _render(node: Any, env: Mapping[str, str], where: str) -> Any:
    if isinstance(node, str):
        return interpolate(node, env, where)
    if isinstance(node, list):
        return [_render(item, env, f"{where}[{i}]") for i, item in enumerate(node)]
    if isinstance(node, dict):
        return {key: _render(item, env, f"{where}.{key}") for key, item in node.items()}
    return node


def render(compose_file: Path, env: Mapping[str, str], *, project_dir: Path | None = None) -> dict[str, Any]:
    """The compose file with anchors merged and variables interpolated, then validated (:func:`validate`).

    Args:
        compose_file: The compose file.
        env: The variables (an env file's, :func:`read_env_file`); the process environment is not read.
        project_dir: Where relative paths start (default: the compose file's folder, as in Compose).
    """
    try:
        raw = yaml.safe_load(compose_file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ComposeError(f"{compose_file.name}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ComposeError(f"{compose_file.name}: the top level must be a mapping")
    # Extension fields (x-*) are templates for anchors; Compose drops them from the model.
    model = _render({k: v for k, v in raw.items() if not str(k).startswith("x-")}, env, "")
    validate(model, project_dir or compose_file.parent)
    return model


def validate(model: dict[str, Any], project_dir: Path) -> None:
    """Structural checks of a rendered model; raises :class:`ComposeError` naming the first problem."""
    unknown = set(model) - TOP_LEVEL_KEYS
    if unknown:
        raise ComposeError(f"unknown top-level keys {sorted(unknown)}")
    services = model.get("services")
    if not isinstance(services, dict) or not services:
        raise ComposeError("no services defined")
    volumes = model.get("volumes") or {}
    for name, service in services.items():
        _check_service(name, service, services, volumes, project_dir)


def _check_service(
    name: str, service: Any, services: Mapping[str, Any], volumes: Mapping[str, Any], project_dir: Path
) -> None:
    where = f"services.{name}"
    if not isinstance(service, dict):
        raise ComposeError(f"{where}: must be a mapping")
    unknown = set(service) - SERVICE_KEYS
    if unknown:
        raise ComposeError(f"{where}: unsupported keys {sorted(unknown)}")
    if "image" not in service and "build" not in service:
        raise ComposeError(f"{where}: has neither image nor build")
    if "build" in service:
        _check_build(where, service["build"], project_dir)
    for i, spec in enumerate(service.get("volumes") or []):
        _check_volume(f"{where}.volumes[{i}]", spec, volumes, project_dir)
    for i, spec in enumerate(service.get("ports") or []):
        if not _PORT.match(str(spec)):
            raise ComposeError(f"{where}.ports[{i}]: {spec!r} is not [IP:]HOST:CONTAINER")
    depends = service.get("depends_on") or {}
    targets = depends if isinstance(depends, dict) else {t: {"condition": "service_started"} for t in depends}
    for target, how in targets.items():
        if target not in services:
            raise ComposeError(f"{where}.depends_on: no service {target!r}")
        condition = (how or {}).get("condition", "service_started")
        if condition not in DEPENDS_CONDITIONS:
            raise ComposeError(f"{where}.depends_on.{target}: unknown condition {condition!r}")
        if condition == "service_healthy" and "healthcheck" not in services[target]:
            raise ComposeError(f"{where}.depends_on.{target}: service_healthy, but {target} has no healthcheck")
    restart = service.get("restart")
    if restart is not None and str(restart).split(":")[0] not in RESTART_POLICIES:
        raise ComposeError(f"{where}.restart: unknown policy {restart!r}")
    health = service.get("healthcheck")
    if health is not None:
        unknown = set(health) - HEALTHCHECK_KEYS
        if unknown:
            raise ComposeError(f"{where}.healthcheck: unsupported keys {sorted(unknown)}")
        for key in ("interval", "timeout", "start_period"):
            if key in health and not _DURATION.match(str(health[key])):
                raise ComposeError(f"{where}.healthcheck.{key}: {health[key]!r} is not a duration")
        test = health.get("test")
        if not (isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL", "NONE")):
            raise ComposeError(f"{where}.healthcheck.test: must be a list starting with CMD or CMD-SHELL")


def _check_build(where: str, build: Any, project_dir: Path) -> None:
    if isinstance(build, str):
        build = {"context": build}
    unknown = set(build) - BUILD_KEYS
    if unknown:
        raise ComposeError(f"{where}.build: unsupported keys {sorted(unknown)}")
    context = (project_dir / build.get("context", ".")).resolve()
    if not context.is_dir():
        raise ComposeError(f"{where}.build.context: {context} is not a folder")
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    if not dockerfile.is_file():
        raise ComposeError(f"{where}.build.dockerfile: {dockerfile} does not exist")


def _check_volume(where: str, spec: Any, volumes: Mapping[str, Any], project_dir: Path) -> None:
    parts = str(spec).split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw", "z", "Z")):
        raise ComposeError(f"{where}: {spec!r} is not SOURCE:TARGET[:MODE]")
    source, target = parts[0], parts[1]
    if not target.startswith("/"):
        raise ComposeError(f"{where}: target {target!r} is not an absolute path")
    if source.startswith((".", "/")):
        path = (project_dir / source).resolve() if source.startswith(".") else Path(source)
        if source.startswith(".") and not path.exists():
            raise ComposeError(f"{where}: bind-mount source {source} does not exist")
    elif source not in volumes:
        raise ComposeError(f"{where}: named volume {source!r} is not declared under the top-level volumes")
