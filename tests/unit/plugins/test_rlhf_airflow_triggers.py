"""RayJobTrigger serialisation and the RayJobWatcher log/offset/event logic (no Ray server)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from airflow.sdk._shared.module_loading import import_string
from airflow.sdk.serde import deserialize, serialize
from ray.job_submission import JobDetails, JobStatus, JobType

from rlhf_airflow.triggers import LOG_TAIL_LINES, RayJobTrigger, RayJobWatcher, tail_lines


def _trigger() -> RayJobTrigger:
    return RayJobTrigger(
        "http://127.0.0.1:8265",
        "af-dag-run-train-0123456789",
        poll_interval=2.5,
        log_offset=42,
        timeout=3600,
        ray_conn_id="ray_prod",
    )


def test_serialize_round_trip_recreates_equal_trigger() -> None:
    classpath, kwargs = _trigger().serialize()
    assert classpath == "rlhf_airflow.triggers.RayJobTrigger"
    # What the triggerer does: serde-encode the kwargs (stored in the DB), decode, import the class, call it.
    stored = deserialize(serialize(kwargs))
    assert isinstance(stored, dict)
    revived = import_string(classpath)(**stored)
    assert isinstance(revived, RayJobTrigger)
    assert revived.serialize() == (classpath, kwargs)
    assert kwargs == {
        "dashboard_address": "http://127.0.0.1:8265",
        "submission_id": "af-dag-run-train-0123456789",
        "poll_interval": 2.5,
        "log_offset": 42,
        "timeout": 3600.0,
        "ray_conn_id": "ray_prod",  # the token stays in the connection: the kwargs are stored in the metadata DB
        "head_outage_s": 600.0,
    }


class _ScriptedRayClient:
    """Stands in for Ray's JobSubmissionClient: returns real JobDetails objects from a script."""

    def __init__(self, steps: list[tuple[str, str]], start_ms: int) -> None:
        self.steps, self.start_ms, self.i = steps, start_ms, -1

    def get_job_info(self, submission_id: str) -> JobDetails:
        self.i = min(self.i + 1, len(self.steps) - 1)
        status = self.steps[self.i][0]
        return JobDetails(
            type=JobType.SUBMISSION,
            entrypoint="python x.py",
            submission_id=submission_id,
            status=JobStatus(status),
            message=f"job is {status}",
            start_time=self.start_ms,
        )

    def get_job_logs(self, submission_id: str) -> str:
        return self.steps[self.i][1]


def test_watcher_streams_complete_lines_once_and_reports_success() -> None:
    import time

    client = _ScriptedRayClient(
        [("RUNNING", "a\nb"), ("RUNNING", "a\nbc\nd"), ("SUCCEEDED", "a\nbc\nd\ne")], int(time.time() * 1000)
    )
    watcher, seen = RayJobWatcher("sub-1"), list[str]()
    assert watcher.step(client, seen.append) is None
    assert seen == ["a"] and watcher.log_offset == 2  # "b" has no newline yet: held back
    assert watcher.step(client, seen.append) is None
    assert seen == ["a", "bc"] and watcher.log_offset == 5  # "a\nbc\n" = 5 chars
    event = watcher.step(client, seen.append)
    assert seen == ["a", "bc", "d", "e"]  # terminal: the partial last line is flushed too
    assert event == {
        "status": "success",
        "submission_id": "sub-1",
        "job_status": "SUCCEEDED",
        "message": "job is SUCCEEDED",
        "log_tail": "a\nbc\nd\ne",
        "log_offset": 8,  # len("a\nbc\nd\ne") = 1+1+2+1+1+1+1
    }


def test_watcher_failed_job_gives_error_with_last_50_lines() -> None:
    logs = "".join(f"line {i}\n" for i in range(120))
    client = _ScriptedRayClient([("FAILED", logs)], 0)
    event = RayJobWatcher("sub-2").step(client, lambda _: None)
    assert event is not None and event["status"] == "error" and event["job_status"] == "FAILED"
    tail = event["log_tail"].splitlines()
    assert len(tail) == LOG_TAIL_LINES == 50
    assert tail[0] == "line 70" and tail[-1] == "line 119"  # 120 lines, last 50 start at index 70


def test_watcher_timeout_counts_from_job_start_time() -> None:
    import time

    started_ms = int((time.time() - 100) * 1000)  # job started 100 s ago on Ray's clock
    client = _ScriptedRayClient([("RUNNING", "x\n")], started_ms)
    assert RayJobWatcher("s", timeout=1000).step(client, lambda _: None) is None
    event = RayJobWatcher("s", timeout=50).step(client, lambda _: None)
    assert event is not None and event["status"] == "timeout" and event["job_status"] == "RUNNING"


def test_tail_lines_keeps_last_n() -> None:
    assert tail_lines("1\n2\n3\n", 2) == "2\n3"
    assert tail_lines("", 5) == ""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_run_yields_error_after_repeated_connection_failures() -> None:
    trigger = RayJobTrigger(f"http://127.0.0.1:{_closed_port()}", "nobody", poll_interval=0.01, head_outage_s=0)

    async def first_event() -> Any:
        return await anext(trigger.run())

    event = asyncio.run(asyncio.wait_for(first_event(), timeout=60))
    assert event.payload["status"] == "error"
    assert event.payload["job_status"] == "UNKNOWN"
    assert "10 consecutive poll failures" in event.payload["message"]


class _RestartingHead(_ScriptedRayClient):
    """A head that stops answering for ``down`` polls, then answers from ``steps`` (or 404s: it lost the job)."""

    def __init__(self, steps: list[tuple[str, str]], down: int, *, lost: bool = False) -> None:
        import time

        super().__init__(steps, int(time.time() * 1000))
        self.down, self.lost = down, lost

    def get_job_info(self, submission_id: str) -> JobDetails:
        if self.down > 0:
            self.down -= 1
            raise ConnectionError("Connection refused")
        if self.lost:
            raise RuntimeError(f"Request failed with status code 404: Job {submission_id} does not exist.")
        return super().get_job_info(submission_id)


def test_watcher_waits_out_a_head_outage_and_re_attaches_to_the_job() -> None:
    head, seen = _RestartingHead([("RUNNING", "a\n"), ("SUCCEEDED", "a\nb\n")], down=12), list[str]()
    watcher = RayJobWatcher("sub", head_outage_s=60)
    events = [watcher.step(head, seen.append) for _ in range(14)]
    assert events[:13] == [None] * 13  # 12 failed polls (more than 10) within head_outage_s: no verdict
    assert events[13] is not None and events[13]["status"] == "success"
    assert "[watcher] the Ray head answers again; sub is RUNNING: re-attached" in seen
    assert watcher.failed_polls == 0


def test_watcher_reports_a_job_the_restarted_head_lost() -> None:
    watcher = RayJobWatcher("sub", head_outage_s=60)
    head = _RestartingHead([("RUNNING", "")], down=3, lost=True)
    events = [watcher.step(head, lambda _: None) for _ in range(4)]
    assert events[:3] == [None] * 3
    assert events[3] is not None and events[3]["status"] == "lost"
    assert "does not exist on the Ray head" in events[3]["message"]
