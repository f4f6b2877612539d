"""Deferrable trigger that watches one Ray job, streaming its driver log into the triggerer log.

``RayJobWatcher`` holds the polling logic (status, log offset, event payload) and is shared by the trigger
(async, the sync Ray client runs in a thread via ``asyncio.to_thread``) and by the operator's
``deferrable=False`` path (plain loop), so both produce the same event payload::

    {"status": "success" | "error" | "timeout" | "lost", "submission_id": str, "job_status": str,
     "message": str, "log_tail": str (last LOG_TAIL_LINES lines), "log_offset": int}

A Ray head that restarts (or stops answering) mid-job does not end the watch: failed polls are retried for
``head_outage_s`` (and at least ``_MAX_CONSECUTIVE_ERRORS`` polls). When the head answers again the watch goes on
if it still has the job (re-attach), or ends with ``"lost"`` when it came back without it (a head restarted
without job history): the operator then resubmits the job with resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

LOG_TAIL_LINES = 50
_MAX_CONSECUTIVE_ERRORS = 10
DEFAULT_HEAD_OUTAGE_S = 600.0  # how long a watch waits for a restarting (or unreachable) Ray head
_ACTIVE = ("PENDING", "RUNNING")


def make_client(address: str, headers: dict[str, str] | None, verify: bool | str) -> JobSubmissionClient:
    """Create a ``JobSubmissionClient`` (blocking: it checks the server version over HTTP)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=headers or None, verify=verify)


def tail_lines(text: str, n: int = LOG_TAIL_LINES) -> str:
    """Last ``n`` lines of ``text`` (without a trailing newline)."""
    return "\n".join(text.rstrip("\n").splitlines()[-n:])


class RayJobWatcher:
    """One poll step at a time: log new complete lines, return an event payload when the job is over.

    Args:
        submission_id: The Ray job to watch.
        log_offset: Characters of the full log already shown (new lines start after it).
        timeout: Seconds since the job's ``start_time`` (Ray's clock, so the limit survives triggerer
            restarts and Airflow retries that re-attach) after which the watcher reports ``"timeout"``.
        head_outage_s: Seconds of failed polls (the head restarting or unreachable) before the watcher reports
            ``"error"``; it also waits for at least ``_MAX_CONSECUTIVE_ERRORS`` failed polls.
    """

    def __init__(
        self,
        submission_id: str,
        *,
        log_offset: int = 0,
        timeout: float | None = None,
        head_outage_s: float = DEFAULT_HEAD_OUTAGE_S,
    ) -> None:
        self.submission_id = submission_id
        self.log_offset = log_offset
        self.timeout = timeout
        self.head_outage_s = head_outage_s
        self._errors = 0
        self._failing_since: float | None = None
        self._started = time.time()

    def step(self, client: JobSubmissionClient, emit: Callable[[str], Any]) -> dict[str, Any] | None:
        """Poll once; ``emit`` receives each new log line. Returns the event payload, or None to keep going."""
        try:
            info = client.get_job_info(self.submission_id)
            logs = client.get_job_logs(self.submission_id)
        except Exception as err:  # network blips must not kill a multi-day watch
            return self.record_error(err, emit)
        if self._errors:
            emit(f"[watcher] the Ray head answers again; {self.submission_id} is {info.status}: re-attached")
        self._errors, self._failing_since = 0, None
        status = str(info.status)
        done = status not in _ACTIVE
        for line in self._new_lines(logs, flush=done):
            emit(line)
        if status == "SUCCEEDED":
            return self._payload("success", status, info.message, logs)
        if done:
            return self._payload("error", status, info.message, logs)
        start = (info.start_time / 1000.0) if info.start_time else self._started
        if self.timeout is not None and time.time() - start > self.timeout:
            return self._payload("timeout", status, f"job still {status} after {self.timeout:.0f}s", logs)
        return None

    def record_error(self, err: Exception, emit: Callable[[str], Any]) -> dict[str, Any] | None:
        """Count a failed poll; ``"lost"`` if the head no longer has the job, ``"error"`` once polls have kept
        failing for ``head_outage_s`` (and at least ``_MAX_CONSECUTIVE_ERRORS`` polls)."""
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "404" in text or "does not exist" in text:
            return self._payload(
                "lost",
                "UNKNOWN",
                f"Ray job {self.submission_id} does not exist on the Ray head (restarted without its job history, "
                f"or the job was deleted): {text}",
                "",
            )
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        self._errors += 1
        down_s = now - self._failing_since
        emit(
            f"[watcher] poll {self._errors} of {self.submission_id} failed ({down_s:.0f} s of "
            f"head_outage_s={self.head_outage_s:g}): {text}"
        )
        if self._errors >= _MAX_CONSECUTIVE_ERRORS and down_s >= self.head_outage_s:
            return self._payload(
                "error", "UNKNOWN", f"{self._errors} consecutive poll failures over {down_s:.0f} s: {text}", ""
            )
        return None

    @property
    def failed_polls(self) -> int:
        """Polls that failed in a row so far (0 once the head answers)."""
        return self._errors

    def _new_lines(self, logs: str, *, flush: bool) -> list[str]:
        if self.log_offset > len(logs):  # log was replaced (e.g. job re-created): show it from the top
            self.log_offset = 0
        new = logs[self.log_offset :]
        if not flush:  # keep a partial last line for the next poll
            new = new[: new.rfind("\n") + 1]
        self.log_offset += len(new)
        return new.splitlines()

    def _payload(self, status: str, job_status: str, message: str | None, logs: str) -> dict[str, Any]:
        return {
            "status": status,
            "submission_id": self.submission_id,
            "job_status": job_status,
            "message": message or "",
            "log_tail": tail_lines(logs),
            "log_offset": self.log_offset,
        }


class RayJobTrigger(BaseTrigger):
    """Poll a Ray job until it ends, logging new driver-log lines; yield one ``TriggerEvent``.

    Args:
        dashboard_address: Ray dashboard / job server URL, e.g. ``http://127.0.0.1:8265``.
        submission_id: The job to watch.
        poll_interval: Seconds between polls.
        log_offset: Characters of the log already shown (lines after it are streamed).
        timeout: See ``RayJobWatcher``; None waits forever.
        head_outage_s: See ``RayJobWatcher``.
        ray_conn_id: Airflow connection (type ``ray``) whose token, headers and TLS ``verify`` the triggerer
            reads when it creates its client (``RayJobHook.aclient_config``). Only the connection's id is in
            the kwargs: Airflow stores them in its ``trigger`` table (in plaintext when no Fernet key is set),
            so no token or header is ever passed here. None: no headers, TLS verified with the system CAs.
    """

    def __init__(
        self,
        dashboard_address: str,
        submission_id: str,
        *,
        poll_interval: float = 5.0,
        log_offset: int = 0,
        timeout: float | None = None,
        ray_conn_id: str | None = None,
        head_outage_s: float = DEFAULT_HEAD_OUTAGE_S,
    ) -> None:
        super().__init__()
        self.head_outage_s = float(head_outage_s)
        self.dashboard_address = dashboard_address
        self.submission_id = submission_id
        self.poll_interval = float(poll_interval)
        self.log_offset = int(log_offset)
        self.timeout = None if timeout is None else float(timeout)
        self.ray_conn_id = ray_conn_id
        self._client: JobSubmissionClient | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Classpath and kwargs that re-create this trigger in the triggerer."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "dashboard_address": self.dashboard_address,
                "submission_id": self.submission_id,
                "poll_interval": self.poll_interval,
                "log_offset": self.log_offset,
                "timeout": self.timeout,
                "ray_conn_id": self.ray_conn_id,
                "head_outage_s": self.head_outage_s,
            },
        )

    async def _get_client(self) -> JobSubmissionClient:
        if self._client is None:
            headers: dict[str, str] = {}
            verify: bool | str = True
            if self.ray_conn_id:
                from rlhf_airflow.hooks import RayJobHook

                hook = RayJobHook(self.ray_conn_id, address=self.dashboard_address)
                _, headers, verify = await hook.aclient_config()
            self._client = await asyncio.to_thread(make_client, self.dashboard_address, headers, verify)
        return self._client

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll until the job is terminal (or times out) and yield a single event."""
        watcher = RayJobWatcher(
            self.submission_id, log_offset=self.log_offset, timeout=self.timeout, head_outage_s=self.head_outage_s
        )
        self.log.info("Watching Ray job %s at %s", self.submission_id, self.dashboard_address)
        while True:
            try:
                client = await self._get_client()
            except Exception as err:  # dashboard restarting: count it like a failed poll
                payload = watcher.record_error(err, self.log.warning)
            else:
                failed_before = watcher.failed_polls
                payload = await asyncio.to_thread(watcher.step, client, self.log.info)
                if watcher.failed_polls > failed_before:
                    self._client = None  # a restarted head: the next poll builds a fresh client
            if payload is not None:
                self.log.info(
                    "Ray job %s finished: %s (%s)", self.submission_id, payload["job_status"], payload["status"]
                )
                yield TriggerEvent(payload)
                return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        """User marked the deferred task failed/success or cleared it: stop the Ray job.

        Airflow 3.3 calls it only on such user actions, not on triggerer restarts or redistribution, so the job
        survives those.
        """
        client = await self._get_client()
        stopped = await asyncio.to_thread(client.stop_job, self.submission_id)
        self.log.info("Stop requested for Ray job %s (was running: %s)", self.submission_id, stopped)

    async def cleanup(self) -> None:
        """Release the HTTP client only; the Ray job keeps running (cleanup also runs on triggerer restarts)."""
        self._client = None
