"""When the controller loop saves, and how it stops: time-based checkpoints, a preemption notice (SIGTERM) and
a resumed run with nothing left to train.

Each way a run ends has its own exit code, so a scheduler can tell them apart without reading logs:
0 trained to the end, 2 a config problem (pre-flight), ``EXIT_NOTHING_LEFT`` (3) resumed at its last step,
``EXIT_PREEMPTED`` (75, ``EX_TEMPFAIL``) stopped by a preemption notice: resubmit it and it resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

EXIT_NOTHING_LEFT = 3
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "try again later"
PREEMPTED_MARKER = "rlhf: preempted"  # the first words of the driver's last line when it stops on a notice


class Preempted(Exception):  # noqa: N818 (an outcome, not an error)
    """The run stopped on a preemption notice; ``committed_step`` is the checkpoint it resumes from."""

    def __init__(self, message: str, *, committed_step: int | None) -> None:
        super().__init__(message)
        self.committed_step = committed_step


class NothingLeftToTrain(Exception):  # noqa: N818 (an outcome, not an error)
    """A resumed run whose checkpoint already completed every step: nothing was trained."""


class SaveSchedule:
    """Whether a step ends with a checkpoint: every ``save_freq`` steps, after ``save_every_s`` seconds since the
    last one (or the start), and at the last step.

    Args:
        save_freq: Steps between checkpoints (0: none by count).
        save_every_s: Seconds between checkpoints (None: none by time).
        clock: Monotonic seconds (a parameter for tests).
    """

    def __init__(
        self, *, save_freq: int, save_every_s: float | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.save_freq, self.save_every_s, self._clock = save_freq, save_every_s, clock
        self._last = clock()
        self.last_save_s: float | None = None  # seconds the last save took
        self.saved_step: int | None = None

    def due(self, step: int, *, is_last: bool) -> str | None:
        """Why ``step`` ends with a checkpoint ('last', 'save_freq', 'save_every_s'), or None."""
        if is_last:
            return "last"
        if self.save_freq and step % self.save_freq == 0:
            return "save_freq"
        if self.save_every_s is not None and self._clock() - self._last >= self.save_every_s:
            return "save_every_s"
        return None

    def saved(self, step: int, *, started: float) -> None:
        """Record a save of ``step`` that began at ``started`` (clock seconds); the time-based interval restarts."""
        self._last = self._clock()
        self.last_save_s = self._last - started
        self.saved_step = step


# A remote notice: what received it (e.g. "SIGTERM to rank 1 of ... on node 10.0.0.3") and when (epoch seconds).
NoticePoll = Callable[[], "tuple[str, float] | None"]


class PreemptionNotice:
    """SIGTERM as a preemption notice with ``grace_s`` seconds to act on it.

    The handler only records the notice (the loop checkpoints at its next safe point, the end of a step) and
    starts the hard stop: if the process is still running ``grace_s`` seconds later it says so and exits with
    ``EXIT_PREEMPTED`` without a new checkpoint (the run resumes from the previous one). Install it from the
    main thread (Python delivers signals there).

    A notice may also reach another process of the run (a worker rank on a node being drained): :meth:`watch`
    adds a poll that reports such notices; :meth:`check` (the loop calls it at each safe point, and a daemon
    thread every ``interval_s``) turns the first one into this notice, with the hard stop counted from when the
    other process received it.
    """

    def __init__(self, grace_s: float, *, exit_fn: Callable[[int], object] = os._exit) -> None:
        self.grace_s = grace_s
        self.received_at: float | None = None
        self.committed_step: int | None = None  # updated by the loop: what the hard stop says it resumes from
        self.stopping = False  # the loop checkpointed after the notice and is shutting down
        self._exit = exit_fn
        self._timer: threading.Timer | None = None
        self._previous: Any = None
        self.source = "SIGTERM"  # what received the notice (a remote one names its process and node)
        self._polls: list[NoticePoll] = []
        self._lock = threading.RLock()  # SIGTERM may arrive while check() notifies
        self._watching = threading.Event()

    @property
    def received(self) -> bool:
        return self.received_at is not None

    def install(self) -> PreemptionNotice:
        """Handle SIGTERM from now on (main thread only); returns self.

        Call it again after ``ray.init``: Ray's driver installs its own fatal-signal handler for SIGTERM (it
        aborts the process), which replaces this one.
        """
        previous = signal.signal(signal.SIGTERM, self._handle)
        if self._previous is None:
            self._previous = previous
        return self

    def uninstall(self) -> None:
        """Back to the previous SIGTERM handler; a pending hard stop is cancelled, watching stops."""
        self.stop_watching()
        if self._timer is not None:
            self._timer.cancel()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:  # a second SIGTERM changes nothing: the first one's deadline holds
            return
        self.notify()

    def notify(self, source: str = "SIGTERM", *, age_s: float = 0.0) -> None:
        """Record a notice (what SIGTERM does) that ``source`` received ``age_s`` seconds ago; start the hard stop.
        A notice after the first changes nothing."""
        with self._lock:
            if self.received:
                return
            age_s = min(max(age_s, 0.0), self.grace_s)
            self.received_at, self.source = time.monotonic() - age_s, source
        log.warning(
            "preemption notice (%s): checkpointing at the end of this step, within trainer.preemption_grace_s=%g s",
            source if not age_s else f"{source}, {age_s:.1f} s ago",
            self.grace_s,
        )
        self._timer = threading.Timer(self.grace_s - age_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, poll: NoticePoll, *, interval_s: float = 0.5) -> PreemptionNotice:
        """Also take notices that ``poll`` reports (``(source, epoch seconds received)`` or None), checked by
        :meth:`check` and, until :meth:`uninstall`, by a daemon thread every ``interval_s``; returns self."""
        self._polls.append(poll)
        if not self._watching.is_set():
            self._watching.set()
            thread = threading.Thread(target=self._watch, args=(interval_s,), name="preemption-watch", daemon=True)
            thread.start()
        return self

    def stop_watching(self) -> None:
        """Take no more notices from the watched sources (the loop is over: ranks stopped by Ray as the run ends
        must not read as a notice)."""
        self._polls.clear()
        self._watching.clear()

    def check(self) -> bool:
        """Poll the watched sources once (a notice found becomes this one); whether a notice was received."""
        for poll in list(self._polls) if not self.received else []:
            try:
                found = poll()
            except Exception as exc:  # a poll that cannot reach its source must not stop training
                log.debug("preemption notice poll failed: %s", exc)
                continue
            if found is not None and self._watching.is_set():  # (stop_watching may have come meanwhile)
                source, at = found
                self.notify(source, age_s=time.time() - at)
                break
        return self.received

    def _watch(self, interval_s: float) -> None:
        while self._watching.is_set() and not self.received:
            self.check()
            time.sleep(interval_s)

    def _expire(self) -> None:
        last = f"step {self.committed_step}" if self.committed_step is not None else "none"
        if self.stopping:  # checkpointed in time; only the shutdown outlived the grace period
            print(f"{PREEMPTED_MARKER}: grace period over during shutdown; checkpoint {last} is committed", flush=True)
            self._exit(EXIT_PREEMPTED)
            return
        print(
            f"{PREEMPTED_MARKER}: could not checkpoint within trainer.preemption_grace_s={self.grace_s:g} s "
            f"of the notice ({self.source}); "
            f"stopping now, the run resumes from its last checkpoint ({last}). Fix: raise "
            "trainer.preemption_grace_s above one step plus one save, or set trainer.save_every_s",
            flush=True,
        )
        self._exit(EXIT_PREEMPTED)

    def elapsed_s(self) -> float:
        """Seconds since the notice (0 before one)."""
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at


def warn_if_grace_too_short(grace_s: float, *, save_s: float, step_s: float) -> bool:
    """Log once-worthy advice when one step plus one save (as measured) would not fit in the grace period."""
    if save_s + step_s <= grace_s:
        return False
    log.warning(
        "trainer.preemption_grace_s=%g is below one step (%.1f s) plus one save (%.1f s) as measured: a preemption "
        "notice would stop the run without a new checkpoint. Fix: set trainer.preemption_grace_s above %.0f",
        grace_s,
        step_s,
        save_s,
        save_s + step_s + 1,
    )
    return True
