"""A preemption notice that reaches a worker rank rather than the driver: a node being drained (a spot reclaim, a
Kubernetes eviction) sends SIGTERM to the processes on it, and the ranks of a multi-node run are there.

A rank does not die on it (unless Ray itself is stopping the actor: its raylet sends a SIGTERM too). Its handler
publishes the notice in the cluster's key-value store (the GCS), under its
job's key, and the rank carries on; the driver watches that key (:func:`watch_rank_notices`, a poll of
:class:`~rlhf_ops.trainer.faults.PreemptionNotice`) and treats the first notice as its own: the controller
checkpoints at the end of the running step (every rank, the noticed one included, takes part), waits for the
upload, and ends as preempted (exit 75), the hard stop counted from when the rank received the notice. If the
run is still there ``grace_s`` plus :data:`RANK_MARGIN_S` after its notice, the rank exits by itself.

Opt-in per process: only ranks whose environment sets :data:`GRACE_ENV` (the training entrypoint's worker
environment does) handle SIGTERM; any other Ray worker keeps Ray's default (exit at once).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from types import FrameType

from rlhf_ops.trainer.faults import EXIT_PREEMPTED, PreemptionNotice

__all__ = ["GRACE_ENV", "RANK_MARGIN_S", "install_rank_handler", "watch_rank_notices"]

log = logging.getLogger(__name__)

GRACE_ENV = "RLHF_PREEMPTION_GRACE_S"
RANK_MARGIN_S = 10.0  # the driver's own hard stop (same grace, counted from the same notice) comes first
_NAMESPACE = "rlhf_ops"


def _key(job_id: str) -> bytes:
    return f"preemption-notice:{job_id}".encode()


class _RankHandler:
    """SIGTERM handler of one rank: publish the notice once (from a thread: never block in a signal handler)."""

    def __init__(self, what: str, grace_s: float) -> None:
        self.what, self.grace_s = what, grace_s
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            return
        self.received = True
        threading.Thread(target=self._act, args=(time.time(),), name="preemption-notice", daemon=True).start()

    def _act(self, at: float) -> None:
        source = f"SIGTERM to {self.what} (pid {os.getpid()})"
        try:
            import ray
            from ray.experimental import internal_kv

            if _stopped_by_ray():  # Ray itself ends this actor (ray.kill, the job's end): no notice, exit as Ray's
                os._exit(1)  # handler would (the raylet's SIGKILL follows in a few seconds anyway)
            job = ray.get_runtime_context().get_job_id()
            value = json.dumps({"source": source, "at": at}).encode()
            internal_kv._internal_kv_put(_key(job), value, overwrite=False, namespace=_NAMESPACE)
            print(f"rlhf: preemption notice ({source}) passed to the driver; this rank goes on", flush=True)
        except Exception as exc:  # the GCS is gone too: nothing to tell; the hard stop below still holds
            print(f"rlhf: preemption notice ({source}) could not reach the driver: {exc}", flush=True)
        time.sleep(self.grace_s + RANK_MARGIN_S)
        print(
            f"rlhf: preempted: {self.what} still running {self.grace_s + RANK_MARGIN_S:g} s after its notice; exiting",
            flush=True,
        )
        os._exit(EXIT_PREEMPTED)


def _stopped_by_ray() -> bool:
    """Whether the GCS already lists this actor as dead: Ray marks an actor dead before its raylet sends the
    process a SIGTERM (then a SIGKILL 5 s later) to stop it, which must not read as a preemption notice."""
    import ray
    from ray._private import state

    actor = ray.get_runtime_context().get_actor_id()
    return actor is not None and state.actors(actor_id=actor).get("State") == "DEAD"


def install_rank_handler(what: str) -> bool:
    """Handle SIGTERM in this rank as a preemption notice if :data:`GRACE_ENV` is set; whether it was installed.

    Args:
        what: The rank as the driver's messages name it, e.g. ``"rank 1 of ActorRolloutRefWorker on node 10.0.0.3"``.
    """
    grace = os.environ.get(GRACE_ENV)
    if not grace or threading.current_thread() is not threading.main_thread():
        return False  # signal handlers can only be set from the main thread (a threaded actor's tasks are not)
    signal.signal(signal.SIGTERM, _RankHandler(what, float(grace)))
    return True


def watch_rank_notices(notice: PreemptionNotice, *, interval_s: float = 0.5) -> None:
    """Make ``notice`` (the driver's) also take the notices its job's ranks publish. Call after ``ray.init``."""
    import ray
    from ray.experimental import internal_kv

    key = _key(ray.get_runtime_context().get_job_id())

    def poll() -> tuple[str, float] | None:
        raw = internal_kv._internal_kv_get(key, namespace=_NAMESPACE)
        if raw is None:
            return None
        found = json.loads(raw)
        return str(found["source"]), float(found["at"])

    notice.watch(poll, interval_s=interval_s)
