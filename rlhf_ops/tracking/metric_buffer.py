"""Metrics that survive a tracking-server outage: a bounded, ordered buffer drained by one sender thread.

``MlflowLogger(buffered=True)`` (what ``rlhf train`` uses) hands each step's metric values to
``MetricBuffer.add``; a daemon thread sends them in order, in batches. While the server answers, ``add`` waits
(up to ``wait_s``) until the step is sent, so a reader sees it at once, as without the buffer. When a send fails
with a transient error (connection refused or reset, timeout, HTTP 5xx / 429) or ``probe`` (asked before each
send, so that a send to a server that is gone does not sit in the client's own retries for minutes) says the
server is away, training stops waiting: one warning line says so, the thread retries with a capped backoff, and
once the server answers the backlog goes out in order and one line says how long the outage lasted. The buffer
holds at most ``max_values``; beyond that the oldest unsent values are dropped and counted. A permanent error
(HTTP 4xx: the server refused the values) drops that batch with an error line. ``close`` waits up to
``timeout_s`` for the backlog, then reports in one line what was never sent.

Nothing here imports MLflow: ``send``, ``probe`` and ``is_permanent`` are given by the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    seq: int
    step: int
    value: Any


@dataclass
class BufferReport:
    """What a ``MetricBuffer`` did over its life (``close`` returns it; ``report()`` gives it any time).

    Attributes:
        added: Values handed to ``add``.
        sent: Values the server accepted.
        dropped: Oldest values dropped because the buffer was full.
        rejected: Values in batches the server refused (permanent errors).
        unsent: Values still buffered when ``close`` gave up.
        outages: Times the server stopped answering.
        longest_outage_s: Longest time from a failed send to the next successful one.
        max_backlog: Most values buffered at once.
        lost_steps: Steps with at least one value dropped, refused or unsent.
    """

    added: int = 0
    sent: int = 0
    dropped: int = 0
    rejected: int = 0
    unsent: int = 0
    outages: int = 0
    longest_outage_s: float = 0.0
    max_backlog: int = 0
    lost_steps: tuple[int, ...] = ()


def _steps(items: Sequence[_Item]) -> str:
    steps = sorted({i.step for i in items})
    if not steps:
        return "no step"
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MetricBuffer:
    """Ordered, bounded metric buffer with a sender thread (see the module docstring).

    Args:
        send: Sends one batch (a list of the values given to ``add``); raises on failure.
        where: The server, for messages (e.g. its URL).
        probe: Optional cheap "does the server answer?" check, asked before each send.
        is_permanent: Whether an exception from ``send`` means the server refused the batch (no retry).
        max_values: Most values kept while the server is away; older ones are dropped beyond it.
        batch_size: Values per ``send`` call.
        wait_s: How long ``add`` waits for its values to be sent while the server answers.
        max_backoff_s: Longest pause between retries during an outage (it starts at 0.5 s and doubles).
        on_recover: Called (on the sender thread) when the server answers again after an outage.
    """

    def __init__(
        self,
        send: Callable[[list[Any]], object],
        *,
        where: str,
        probe: Callable[[], bool] | None = None,
        is_permanent: Callable[[BaseException], bool] = lambda exc: False,
        max_values: int = 100_000,
        batch_size: int = 1000,
        wait_s: float = 10.0,
        max_backoff_s: float = 5.0,
        on_recover: Callable[[], None] | None = None,
    ) -> None:
        if max_values < 1 or batch_size < 1:
            raise ValueError(f"MetricBuffer: max_values and batch_size must be >= 1, got {max_values}, {batch_size}")
        self._send, self._probe, self._is_permanent = send, probe, is_permanent
        self._on_recover = on_recover
        self.where = where
        self.max_values, self.batch_size, self.wait_s, self.max_backoff_s = (
            max_values,
            batch_size,
            wait_s,
            max_backoff_s,
        )
        self._cond = threading.Condition()
        self._pending: deque[_Item] = deque()
        self._inflight: list[_Item] = []
        self._seq = 0
        self._closing = False
        self._abandoned = False
        self._retry_now = False  # set by flush(): retry without waiting out the backoff
        self._stalled = False  # an add timed out waiting: do not wait again until the backlog is gone
        self._outage_since: float | None = None
        self._lost: set[int] = set()
        self._report = BufferReport()
        self._thread = threading.Thread(target=self._run, name="rlhf-metric-sender", daemon=True)
        self._thread.start()

    # ---- training thread ----------------------------------------------------------------------
    @property
    def backlog(self) -> int:
        """Values not yet sent (buffered or in flight)."""
        with self._cond:
            return len(self._pending) + len(self._inflight)

    def add(self, values: Sequence[Any], *, step: int) -> None:
        """Queue one step's values; wait for them to be sent unless the server is away.

        Raises:
            ValueError: the buffer is closed.
        """
        with self._cond:
            if self._closing:
                raise ValueError(f"MetricBuffer for {self.where} is closed; create a new logger")
            for value in values:
                self._seq += 1
                self._pending.append(_Item(self._seq, step, value))
            self._report.added += len(values)
            self._drop_overflow()
            self._report.max_backlog = max(self._report.max_backlog, len(self._pending) + len(self._inflight))
            self._cond.notify_all()
            if self._outage_since is not None or self._stalled:
                return
            last, deadline = self._seq, time.monotonic() + self.wait_s
            while self._oldest_seq() <= last and self._outage_since is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stalled = True  # the sender is stuck in a slow request: training goes on
                    _log.warning("%s is slow to answer; training goes on, metrics are buffered", self.where)
                    return
                self._cond.wait(left)

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until nothing is buffered; returns whether that happened."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._retry_now = True  # a sender waiting out a backoff tries now
            self._cond.notify_all()
            while self._pending or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self, timeout_s: float = 120.0) -> BufferReport:
        """Send what is left (up to ``timeout_s``), stop the thread, log what was lost; returns the report."""
        with self._cond:
            if self._closing:
                return self.report()
            self._closing = True
        flushed = self.flush(timeout_s)
        with self._cond:
            left = [*self._inflight, *self._pending]
            self._abandoned = True
            self._pending.clear()
            self._cond.notify_all()
            if left:
                self._report.unsent = len(left)
                self._lost.update(i.step for i in left)
        if not flushed and left:
            since = self._outage_since
            away = f" (not answering for {time.monotonic() - since:.0f} s)" if since is not None else ""
            _log.warning(
                "%s%s: %d metric values of %s were not sent; the run's console / JSONL logs have them",
                self.where,
                away,
                len(left),
                _steps(left),
            )
        self._thread.join(timeout=1.0)
        report = self.report()
        if report.dropped or report.rejected or report.outages:
            _log.warning(
                "metrics for %s: %d sent, %d dropped (buffer full), %d refused, %d unsent; "
                "%d outage(s), longest %.0f s",
                self.where,
                report.sent,
                report.dropped,
                report.rejected,
                report.unsent,
                report.outages,
                report.longest_outage_s,
            )
        return report

    def report(self) -> BufferReport:
        """A snapshot of the figures so far."""
        with self._cond:
            r = self._report
            return BufferReport(
                added=r.added,
                sent=r.sent,
                dropped=r.dropped,
                rejected=r.rejected,
                unsent=r.unsent,
                outages=r.outages,
                longest_outage_s=round(r.longest_outage_s, 2),
                max_backlog=r.max_backlog,
                lost_steps=tuple(sorted(self._lost)),
            )

    # ---- both (callers hold the lock) ---------------------------------------------------------
    def _oldest_seq(self) -> float:
        if self._inflight:
            return self._inflight[0].seq
        return self._pending[0].seq if self._pending else float("inf")

    def _drop_overflow(self) -> None:
        over = len(self._pending) + len(self._inflight) - self.max_values
        if over <= 0 or not self._pending:
            return
        dropped = [self._pending.popleft() for _ in range(min(over, len(self._pending)))]
        if not self._report.dropped:  # one line per run; close() reports the total
            _log.warning(
                "%s: metric buffer full (%d values); dropping the oldest, starting with %s",
                self.where,
                self.max_values,
                _steps(dropped),
            )
        self._report.dropped += len(dropped)
        self._lost.update(i.step for i in dropped)

    # ---- sender thread ------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                while not self._pending and not self._abandoned:
                    self._cond.wait()
                if self._abandoned:
                    return
                n = min(self.batch_size, len(self._pending))
                self._inflight = [self._pending.popleft() for _ in range(n)]
                batch = list(self._inflight)
            error: BaseException | None = None
            # Probe first: a send to a server that is gone sits in the client's own retries for minutes.
            if self._probe is not None and not self._safe_probe():
                error = ConnectionError("no answer to the health probe")
            else:
                try:
                    self._send([i.value for i in batch])
                except Exception as exc:  # classified below: refused (dropped) or transient (retried)
                    error = exc
            with self._cond:
                self._inflight = []
                if error is None:
                    self._report.sent += len(batch)
                    self._sent_ok(batch)
                    backoff = 0.5
                    continue
                if self._is_permanent(error):
                    self._report.rejected += len(batch)
                    self._lost.update(i.step for i in batch)
                    _log.error(
                        "%s refused %d metric values of %s; they are dropped: %s",
                        self.where,
                        len(batch),
                        _steps(batch),
                        _one_line(error),
                    )
                    self._cond.notify_all()
                    continue
                self._pending.extendleft(reversed(batch))  # retried first: order is kept
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    self._report.outages += 1
                    _log.warning(
                        "%s is not answering (%s); training goes on, metrics are buffered (up to %d values) "
                        "and sent when it is back",
                        self.where,
                        _one_line(error),
                        self.max_values,
                    )
                self._cond.notify_all()  # wake add(): it stops waiting during an outage
                # Wait out the backoff; flush() / close() cut it short (new steps do not: they only queue).
                deadline = time.monotonic() + backoff
                while not self._abandoned and not self._retry_now and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                self._retry_now = False
                backoff = min(backoff * 2, 1.0 if self._closing else self.max_backoff_s)

    def _sent_ok(self, batch: list[_Item]) -> None:
        """After ``batch`` was sent (lock held): end an outage, clear a stall, wake waiters."""
        if self._outage_since is not None:
            seconds = time.monotonic() - self._outage_since
            self._report.longest_outage_s = max(self._report.longest_outage_s, seconds)
            self._outage_since = None
            backlog = [*batch, *self._pending]
            _log.warning(
                "%s answers again after %.0f s; sending the %d buffered metric values (%s)",
                self.where,
                seconds,
                len(backlog),
                _steps(backlog),
            )
            if self._on_recover is not None:
                threading.Thread(target=self._safe_recover, name="rlhf-metric-recover", daemon=True).start()
        if not self._pending:
            self._stalled = False
        self._cond.notify_all()

    def _safe_probe(self) -> bool:
        try:
            return bool(self._probe and self._probe())
        except Exception:  # a probe that raises means "not answering"
            return False

    def _safe_recover(self) -> None:
        try:
            if self._on_recover is not None:
                self._on_recover()
        except Exception as exc:  # best effort (e.g. restarting the system-metrics monitor)
            _log.warning("after %s came back: %s", self.where, _one_line(exc))
