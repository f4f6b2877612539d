"""The demo's local services start on 127.0.0.1, answer, and stop by PID leaving no process behind."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from rlhf_ops.pipeline.local_stack import start_mlflow_server, start_ray_head

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ours(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if proc.info["uids"].real == os.getuid() and marker in " ".join(proc.info["cmdline"] or []):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc.pid)
        except (psutil.Error, TypeError, AttributeError):
            continue
    return found


def test_mlflow_server_serves_and_stops(tmp_path: Path) -> None:
    server = start_mlflow_server(tmp_path / "mlflow")
    try:
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as resp:
            assert resp.status == 200
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop()
    assert not _alive(server.pid)
    assert not _ours(f"--port {server.url.rsplit(':', 1)[1]}")  # the uvicorn worker went with it
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()


def test_ray_head_runs_a_job_with_this_interpreter_and_stops(tmp_path: Path) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    head = start_ray_head(tmp_path, num_cpus=1)
    try:
        client = JobSubmissionClient(head.url)
        job = client.submit_job(entrypoint="python -c \"import sys; print('exe=' + sys.executable)\"")
        status = client.get_job_status(job)
        deadline = time.monotonic() + 120
        while status not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
            status = client.get_job_status(job)
        assert status == JobStatus.SUCCEEDED
        assert f"exe={Path(sys.executable).parent}" in client.get_job_logs(job)  # the venv's python, via PATH
        with urllib.request.urlopen(f"{head.url}/api/jobs/", timeout=10) as resp:
            assert len(json.loads(resp.read())) == 1
    finally:
        head.stop()
    assert not _alive(head.pid)
    assert not _ours("rayd_")  # no daemon of this head survives (others' clusters are untouched)


def test_ray_head_with_a_token_refuses_requests_without_it(tmp_path: Path) -> None:
    import urllib.error

    token = "local-stack-test-token"
    head = start_ray_head(tmp_path, num_cpus=1, auth_token=token)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{head.url}/api/jobs/", timeout=10)
        assert refused.value.code in (401, 403)
        request = urllib.request.Request(f"{head.url}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read()) == []
    finally:
        head.stop()
    assert not _alive(head.pid)
