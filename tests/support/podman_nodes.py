"""A Ray cluster of separate podman containers on one bridge network, for the multi-node fault tests.

Each Ray node is a container of the CPU worker image (``scripts/stack.sh build``) with its own filesystem and its
own address on a network of its own; a moto S3 container (the services image) is the only store they share. No
volume is mounted: the checkout's ``rlhf_ops`` and ``workers`` packages and ``docker/ray-entrypoint.sh`` are
copied into each container (``podman cp``) before it starts, so the nodes run the code under test on the image's
installed dependencies (``PYTHONPATH`` puts the copy before the installed wheel), and so is the model, at the same
path on every node (:data:`MODEL_DIR`), as weights staged on each node's own disk.

Everything it creates carries one label and is removed by :meth:`PodmanCluster.close`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER_IMAGE = "rlhf-ops/worker-cpu:local"
SERVICES_IMAGE = "rlhf-ops/services:local"
MODEL_DIR = "/models/model"
S3_PORT, GCS_PORT, DASHBOARD_PORT = 5000, 6379, 8265
_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": "/opt/rlhf-src", "RAY_DEDUP_LOGS": "0"}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One podman command; raises with its stderr when ``check`` and it fails."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"podman {' '.join(args[:3])} ... failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return done


def missing_prerequisite() -> str | None:
    """Why this machine cannot run the cluster (None: it can)."""
    if shutil.which("podman") is None:
        return "podman is not installed (bash docker/podman-setup.sh)"
    for image in (WORKER_IMAGE, SERVICES_IMAGE):
        if podman("image", "exists", image, check=False).returncode != 0:
            return f"image {image} not found (bash scripts/stack.sh build)"
    return None


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> float:
    """Seconds until ``check()`` held; raises TimeoutError naming ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - start


class PodmanCluster:
    """A network, a moto S3 container, a Ray head container (no CPUs: ranks go to the workers) and worker-node
    containers added with :meth:`add_node` (1 CPU each)."""

    def __init__(self, work: Path, *, model_dir: str, node_grace_s: float = 60.0) -> None:
        self.name = f"rlhf-nodes-{uuid.uuid4().hex[:6]}"
        self.label = f"rlhf-ops.test={self.name}"
        self.work = work
        self.node_grace_s = node_grace_s
        self.nodes: list[str] = []  # worker-node containers, in the order they were added
        self._source = self._stage_source()
        self._model = Path(model_dir)
        podman("network", "create", "--label", self.label, self.name)
        self.s3 = self._run("s3", SERVICES_IMAGE, {}, ["moto_server", "-H", "0.0.0.0", "-p", str(S3_PORT)])
        self.s3_url = f"http://{self.ip(self.s3)}:{S3_PORT}"
        head_env = {"RAY_NODE_TYPE": "head", "RAY_START_ARGS": "--num-cpus=0 --object-store-memory=150000000"}
        self.head = self._create("head", WORKER_IMAGE, {**_RAY_ENV, **head_env}, [])
        self._start(self.head)
        self.dashboard = f"http://{self.ip(self.head)}:{DASHBOARD_PORT}"

    # ---- containers ------------------------------------------------------------------------------
    def _stage_source(self) -> Path:
        stage = self.work / "src"
        for package in ("rlhf_ops", "workers"):
            shutil.copytree(ROOT / package, stage / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy2(ROOT / "docker" / "ray-entrypoint.sh", self.work / "ray-entrypoint.sh")
        (self.work / "ray-entrypoint.sh").chmod(0o755)
        return stage

    def _create(self, role: str, image: str, env: dict[str, str], cmd: list[str]) -> str:
        name = f"{self.name}-{role}"
        flags = [f"--env={k}={v}" for k, v in env.items()]
        podman("create", "--name", name, "--label", self.label, "--network", self.name, "--shm-size=512m",
               "--hostname", role, *flags, image, *cmd)  # fmt: skip
        return name

    def _start(self, name: str) -> None:
        # The code under test, copied in (no volume): the packages and the node entrypoint.
        podman("cp", str(self._source), f"{name}:/opt/rlhf-src")
        podman("cp", str(self.work / "ray-entrypoint.sh"), f"{name}:/usr/local/bin/ray-entrypoint.sh")
        podman("cp", str(self._model), f"{name}:{MODEL_DIR}")
        podman("start", name)

    def _run(self, role: str, image: str, env: dict[str, str], cmd: list[str]) -> str:
        name = self._create(role, image, env, cmd)
        podman("start", name)
        return name

    def add_node(self) -> str:
        """Start one more worker node (its own container, disk and address); returns its container name."""
        env = {
            **_RAY_ENV,
            "RAY_NODE_TYPE": "worker",
            "RAY_HEAD_ADDRESS": f"{self.ip(self.head)}:{GCS_PORT}",
            "RAY_START_ARGS": "--num-cpus=1 --object-store-memory=150000000",
            "RAY_PREEMPTION_GRACE_S": f"{self.node_grace_s:g}",
        }
        name = self._create(f"w{len(self.nodes) + 1}", WORKER_IMAGE, env, [])
        self._start(name)
        self.nodes.append(name)
        return name

    def ip(self, name: str) -> str:
        out = podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", name).stdout
        return str((json.loads(out) or {}).get(self.name, {}).get("IPAddress", ""))

    def running(self, name: str) -> bool:
        out = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
        return out == "running"

    def exit_code(self, name: str) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())

    def processes(self, name: str) -> list[str]:
        """``pid args`` of every process in a running container (empty if it is not running)."""
        if not self.running(name):
            return []
        done = podman("exec", name, "ps", "-eo", "pid=,args=", check=False)
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]

    def run_processes(self, name: str) -> list[str]:
        """The training's processes in a container: busy Ray workers (ranks) and training drivers."""
        found = []
        for line in self.processes(name):
            args = line.split(None, 1)[1] if " " in line else ""
            name = args.split(None, 1)[0] if args else ""
            ray_own = name in ("ray::IDLE", "ray::JobSupervisor") or name.endswith("Agent")  # Ray's, not the run's
            rank = name.startswith("ray::") and not ray_own
            if rank or "workers.entrypoints.train" in args:
                found.append(line)
        return found

    def read(self, name: str, path: str) -> str:
        done = podman("exec", name, "cat", path, check=False)
        return done.stdout if done.returncode == 0 else ""

    # ---- Ray ------------------------------------------------------------------------------------
    def api(self, path: str) -> Any:
        with urllib.request.urlopen(self.dashboard + path, timeout=10) as response:
            return json.loads(response.read())

    def alive_nodes(self) -> dict[str, str]:
        """``{node ip: node id}`` of the alive Ray nodes (the head included)."""
        try:
            rows = self.api("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        except (OSError, ValueError, KeyError):
            return {}
        return {row["node_ip"]: row["node_id"] for row in rows if row["state"] == "ALIVE"}

    def wait_nodes(self, names: list[str], timeout_s: float = 240) -> float:
        """Wait until the head and exactly the worker nodes ``names`` are alive in Ray."""
        want = {self.ip(self.head), *(self.ip(n) for n in names)}

        def ready() -> bool:
            for name in [self.head, *names]:
                if not self.running(name):
                    raise RuntimeError(f"container {name} exited: {self.logs(name)[-2000:]}")
            return set(self.alive_nodes()) == want

        return wait_for(f"Ray nodes {sorted(want)} alive", ready, timeout_s, poll_s=1.0)

    def logs(self, name: str) -> str:
        done = podman("logs", name, check=False)
        return done.stdout + done.stderr

    def close(self) -> list[str]:
        """Remove every container and the network (logs saved under the work folder); returns what was left
        running before the removal (the test's count of containers left behind)."""
        names = podman("ps", "-a", "--filter", f"label={self.label}", "--format", "{{.Names}}", check=False)
        left = []
        for name in names.stdout.split():
            if self.running(name) and name not in (self.head, self.s3):
                left.append(name)
            (self.work / f"{name}.log").write_text(self.logs(name))
            podman("rm", "-f", "-t", "0", name, check=False, timeout=120)
        podman("network", "rm", "-f", self.name, check=False)
        return left
