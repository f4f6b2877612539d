"""Waiting on the ranks of a worker group without hanging when one of them dies.

SPMD ranks block in collectives: if rank 1 dies, rank 0 may wait in an ``all_reduce`` for ever
(NCCL) or until a 30-minute timeout. A plain ``ray.get`` on rank 0's result would hang with it.
So every wait here polls *all* ranks' futures with ``ray.wait``; the first failed future aborts
its group (every actor killed) and raises :class:`WorkerGroupError`. After the first failure the
others are given ``failure_grace_s`` to report, so that the rank whose *process died* is named
rather than a peer that merely saw its connection drop.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError

__all__ = ["GroupFuture", "WorkerGroupError", "root_cause_rank", "wait_all"]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NODE = re.compile(r"\bip: (\S+)")  # Ray's ActorDiedError names the dead actor's node and pid
_PID = re.compile(r"\bpid: (\d+)")


class WorkerGroupError(RuntimeError):
    """A rank of a worker group failed (process died, or its method raised), or the call timed out.

    Attributes:
        role: The group's ``name_prefix`` (e.g. ``"actor_rollout_ref"``).
        rank: The rank blamed for the failure (``None`` for a timeout or a closed group).
        method: The worker method being called.
        cause: The original error (``ray.exceptions.ActorDiedError``, ``RayTaskError`` wrapping the
            worker's exception, ``GetTimeoutError``...), also chained as ``__cause__``.
        failed_ranks: Every rank that failed within the grace period, by rank.
    """

    def __init__(
        self,
        role: str,
        rank: int | None,
        method: str,
        cause: BaseException | None,
        failed_ranks: dict[int, BaseException] | None = None,
        detail: str = "",
        location: tuple[str, int | None] | None = None,
    ) -> None:
        self.role, self.rank, self.method, self.cause = role, rank, method, cause
        self.failed_ranks = dict(failed_ranks or {})
        self.location = location
        where = f"rank {rank}" if rank is not None else "worker group"
        text = detail or (f"{type(cause).__name__}: {cause}" if cause is not None else "failed")
        text = _ANSI.sub("", text)  # Ray colours its tracebacks; logs and Airflow UIs show raw escapes
        if rank is not None and isinstance(cause, RayActorError):
            # The node whose process died (a preempted or lost node), on the first line: from Ray's text
            # (ActorDiedError names it) or, where the text does not (ActorUnavailableError), from the GCS.
            node, pid = (m.group(1) if (m := _NODE.search(text)) else None), _PID.search(text)
            found = (node, pid.group(1) if pid else None) if node else location
            if found is not None:
                where += f" on node {found[0]}" + (f" (pid {found[1]})" if found[1] else "")
        self._text = text
        others = sorted(set(self.failed_ranks) - {rank})
        also = f" (ranks {others} failed too)" if others else ""
        super().__init__(f"[{role}] {where} failed in {method}(){also}: {text}")

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.role, self.rank, self.method, self.cause, self.failed_ranks, self._text, self.location)
        return (type(self), args)


@dataclass(kw_only=True)
class _Pending:
    """The futures of one group call plus how to finish and abort it."""

    role: str
    method: str
    refs: list[ray.ObjectRef]  # index i is rank ranks[i]
    ranks: list[int]
    finish: Callable[[list[Any]], Any]
    abort: Callable[[], None]
    values: dict[int, Any] = field(default_factory=dict)  # rank -> return value


class GroupFuture:
    """The pending result of ``RayWorkerGroup.call_async`` (or of a ``blocking=False`` method).

    ``result()`` waits for every rank (failing fast as described in the module docstring) and
    returns what ``call`` would have returned.
    """

    def __init__(self, pending: _Pending, *, poll_interval_s: float, failure_grace_s: float) -> None:
        self._pending = pending
        self._poll_interval_s = poll_interval_s
        self._failure_grace_s = failure_grace_s
        self._done = False
        self._result: Any = None

    @property
    def method(self) -> str:
        """Name of the worker method called."""
        return self._pending.method

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not); never blocks."""
        if self._done:
            return True
        _, not_ready = ray.wait(list(self._pending.refs), num_returns=len(self._pending.refs), timeout=0)
        return not not_ready

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait for every rank and return the dispatched result.

        Args:
            timeout_s: Give up after this many seconds: the group is aborted (its collectives are
                in an unknown state) and :class:`WorkerGroupError` raised. ``None`` waits for ever.

        Raises:
            WorkerGroupError: A rank failed or the timeout passed; the group has been shut down.
        """
        if not self._done:
            wait_all([self], timeout_s=timeout_s)
        return self._result

    def _set_values(self) -> None:
        p = self._pending
        self._result = p.finish([p.values[r] for r in p.ranks])
        self._done = True


def wait_all(futures: Sequence[GroupFuture], *, timeout_s: float | None = None) -> list[Any]:
    """Wait for several calls at once, e.g. two colocated groups computing concurrently.

    All futures are polled together, so a failure in any group is seen while waiting on another.

    Returns:
        Each future's result, in order.

    Raises:
        WorkerGroupError: For the first failing call; its group is shut down (the other groups
            are left running).
    """
    todo = [f for f in futures if not f._done]
    if todo:
        poll = min(f._poll_interval_s for f in todo)
        grace = max(f._failure_grace_s for f in todo)
        _wait_refs([f._pending for f in todo], timeout_s=timeout_s, poll_interval_s=poll, failure_grace_s=grace)
        for f in todo:
            f._set_values()
    return [f._result for f in futures]


def _wait_refs(
    calls: list[_Pending], *, timeout_s: float | None, poll_interval_s: float, failure_grace_s: float
) -> None:
    owner: dict[ray.ObjectRef, tuple[_Pending, int]] = {}
    for call in calls:
        for ref, rank in zip(call.refs, call.ranks, strict=True):
            owner[ref] = (call, rank)
    pending = list(owner)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait_s = poll_interval_s if deadline is None else max(0.0, min(poll_interval_s, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        failed = _fetch(ready, owner)
        if failed is not None:
            _raise_failure(failed, pending, owner, failure_grace_s)
        if pending and deadline is not None and time.monotonic() >= deadline:
            _raise_timeout(pending, owner, timeout_s)


def _raise_timeout(
    pending: list[ray.ObjectRef], owner: dict[ray.ObjectRef, tuple[_Pending, int]], timeout_s: float | None
) -> None:
    """Abort every group that still has a running rank (its collectives are in an unknown state) and raise."""
    stuck: dict[int, tuple[_Pending, list[int]]] = {}
    for ref in pending:
        call, rank = owner[ref]
        stuck.setdefault(id(call), (call, []))[1].append(rank)
    for call, _ in stuck.values():
        call.abort()
    call, ranks = next(iter(stuck.values()))
    detail = f"timed out after {timeout_s}s waiting for ranks {sorted(ranks)}; the group was shut down"
    raise WorkerGroupError(
        call.role, None, call.method, GetTimeoutError(f"ranks {sorted(ranks)} still running"), detail=detail
    )


def _fetch(ready: list[ray.ObjectRef], owner: dict[ray.ObjectRef, tuple[_Pending, int]]) -> _Pending | None:
    """Store the values of ``ready`` futures; return the first call with a failed rank, if any."""
    failed: _Pending | None = None
    for ref in ready:
        call, rank = owner[ref]
        try:
            call.values[rank] = ray.get(ref)
        except Exception as err:  # RayActorError (process died) or RayTaskError (the method raised)
            call.values[rank] = _Failure(err)
            failed = failed or call
    return failed


@dataclass(frozen=True)
class _Failure:
    error: BaseException


def _raise_failure(
    call: _Pending, pending: list[ray.ObjectRef], owner: dict[ray.ObjectRef, tuple[_Pending, int]], grace_s: float
) -> None:
    """Give peers ``grace_s`` to report, abort ``call``'s group and raise for the root-cause rank."""
    mine = [r for r in pending if owner[r][0] is call]
    if mine and grace_s > 0:
        ready, _ = ray.wait(mine, num_returns=len(mine), timeout=grace_s)
        _fetch(ready, owner)
    call.abort()
    failures = {rank: v.error for rank, v in call.values.items() if isinstance(v, _Failure)}
    rank = root_cause_rank(failures)
    location = actor_location(failures[rank])
    raise WorkerGroupError(call.role, rank, call.method, failures[rank], failures, location=location) from failures[
        rank
    ]


def actor_location(error: BaseException) -> tuple[str, int | None] | None:
    """``(node IP, pid)`` of the actor a ``RayActorError`` is about, from the GCS (None: not one, or unknown).

    ``ActorUnavailableError`` (the connection to the actor's process broke: its node was lost) does not name the
    node the way ``ActorDiedError`` does; the GCS still has the actor's address.
    """
    actor_id = getattr(error, "actor_id", None) if isinstance(error, RayActorError) else None
    if not actor_id or _NODE.search(str(error)):
        return None
    try:
        from ray._private import state

        info = state.actors(actor_id=actor_id)
    except Exception:  # the GCS is unreachable too: the message goes without the node
        return None
    ip = (info.get("Address") or {}).get("IPAddress")
    return (str(ip), int(info["Pid"]) if info.get("Pid") else None) if ip else None


def root_cause_rank(failures: dict[int, BaseException]) -> int:
    """The rank whose error explains the others: the lowest rank whose process died (RayActorError) or was
    killed by Ray's memory monitor (OutOfMemoryError), else the lowest failed rank.

    Peers of a dead rank usually fail only because their collective's connection to it broke (gloo's
    "Connection closed by peer"), which names no cause.
    """
    died = [rank for rank, err in failures.items() if isinstance(err, (RayActorError, OutOfMemoryError))]
    return min(died) if died else min(failures)
