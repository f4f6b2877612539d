"""``RayWorkerGroup``: N Ray actors of one worker class, one per rank, driven from the controller.

The driver calls worker methods by name or by reference, and the method's ``@register`` spec
decides how arguments are dispatched and results collected::

    with RayResourcePool([2], use_gpu=False) as pool:
        critic = RayWorkerGroup(pool, CriticWorker, worker_kwargs={"lr": 1e-5}, name_prefix="critic")
        critic.call(CriticWorker.init_model)                    # ONE_TO_ALL -> [None, None]
        values = critic.call(CriticWorker.compute_values, batch)  # DP_COMPUTE_PROTO -> DataProto

There is no generated proxy: a role that wants a typed driver-side API writes a small client
class whose methods call ``group.call`` (see ``docs/single_controller.md``). Passing the method
itself (``CriticWorker.compute_values``) rather than its name lets mypy check the arguments.

Failure policy: any failure of any rank (process death, an exception in the method, a timeout)
kills every actor of the group and raises :class:`WorkerGroupError`; the group is then closed.
SPMD ranks cannot recover from a peer failing mid-collective, so the controller must restart
from a checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlhf_ops.protocol import DataProto
from workers.single_controller.decorator import Dispatch, DispatchSpec, registered_methods, resolve_method
from workers.single_controller.dispatch import DPLayout, collect_dp_outputs, split_args_for_dp
from workers.single_controller.futures import GroupFuture, WorkerGroupError, _Pending
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker import RankContext, Worker

__all__ = ["RayWorkerGroup"]

_log = logging.getLogger(__name__)

W = TypeVar("W", bound=Worker)
P = ParamSpec("P")


class RayWorkerGroup(Generic[W]):
    """One Ray actor of ``worker_cls`` per bundle of ``resource_pool``, forming one process group.

    Args:
        resource_pool: The bundles to run on; rank ``r`` runs in bundle ``r``.
        worker_cls: A :class:`Worker` subclass; its constructor takes ``(ctx: RankContext, **worker_kwargs)``.
        worker_kwargs: Keyword arguments for every rank's constructor.
        name_prefix: The role name, used in errors and actor names (e.g. ``"critic"``).
        backend: ``torch.distributed`` backend (see ``worker.resolve_backend``).
        resource_share: Fraction of each bundle's CPU (and GPU) one actor takes; ``1/k`` lets ``k``
            colocated groups share the pool.
        init_timeout_s: Limit for starting the actors and creating the process group.
        poll_interval_s: How often waits check every rank for failures.
        failure_grace_s: After a first failure, how long to let other ranks report before blaming one.

    Raises:
        WorkerGroupError: A rank failed to start or to join the process group (the group is shut down).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        worker_cls: type[W],
        *,
        worker_kwargs: Mapping[str, Any] | None = None,
        name_prefix: str,
        backend: str = "auto",
        resource_share: float = 1.0,
        init_timeout_s: float = 120.0,
        poll_interval_s: float = 0.5,
        failure_grace_s: float = 2.0,
    ) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"worker_cls must be a subclass of Worker, got {worker_cls!r}.")
        if not 0 < resource_share <= 1:
            raise ValueError(f"resource_share={resource_share} must be in (0, 1]; use 1/k for k colocated groups.")
        self.worker_cls = worker_cls
        self.name_prefix = name_prefix
        self._registered = registered_methods(worker_cls)
        self._poll_interval_s = poll_interval_s
        self._failure_grace_s = failure_grace_s
        self._pool = resource_pool
        self._closed = False
        self._dp_layout: DPLayout | None = None
        self._actors: list[Any] = []
        slots = resource_pool.acquire(self)
        try:
            self._actors = self._create_actors(slots, dict(worker_kwargs or {}), resource_share)
            self.backend = self._init_process_group(backend, init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._actors)

    @property
    def registered(self) -> dict[str, DispatchSpec]:
        """The callable methods of ``worker_cls`` and their dispatch specs."""
        return dict(self._registered)

    @property
    def closed(self) -> bool:
        """Whether the group was shut down (explicitly or after a failure)."""
        return self._closed

    @overload
    def call(self, method: Callable[Concatenate[W, P], Any], /, *args: P.args, **kwargs: P.kwargs) -> Any: ...
    @overload
    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any: ...
    def call(self, method: Callable[..., Any] | str, /, *args: Any, **kwargs: Any) -> Any:
        """Call a registered worker method on the group and collect the result per its dispatch mode.

        Args:
            method: The method (``CriticWorker.compute_values``) or its name (``"compute_values"``).
            *args: Arguments; for ``DP_COMPUTE_PROTO`` every ``DataProto`` is split across DP ranks.
            **kwargs: Keyword arguments, dispatched like ``args``.

        Returns:
            ``ONE_TO_ALL``: list of every rank's return value, by rank. ``DP_COMPUTE_PROTO``: the
            gathered ``DataProto`` (row order of the input).
            For a method registered with ``blocking=False``: a :class:`GroupFuture` of that value.

        Raises:
            AttributeError: ``method`` is not a ``@register``-ed method of ``worker_cls``.
            WorkerGroupError: A rank failed; every actor of the group has been killed.
        """
        future = self.call_async(method, *args, **kwargs)
        return future if not self._registered[future.method].blocking else future.result()

    @overload
    def call_async(
        self, method: Callable[Concatenate[W, P], Any], /, *args: P.args, **kwargs: P.kwargs
    ) -> GroupFuture: ...
    @overload
    def call_async(self, method: str, /, *args: Any, **kwargs: Any) -> GroupFuture: ...
    def call_async(self, method: Callable[..., Any] | str, /, *args: Any, **kwargs: Any) -> GroupFuture:
        """Like :meth:`call` but returns at once with a :class:`GroupFuture` (wait with ``result()``
        or ``futures.wait_all``)."""
        name, spec = self._resolve(method)
        if self._closed:
            raise WorkerGroupError(self.name_prefix, None, name, None, detail="the worker group is shut down")
        if spec.mode is Dispatch.ONE_TO_ALL:
            put_args, put_kwargs = _put_data(args, kwargs)  # one copy of a batch for all ranks
            refs = [getattr(a, name).remote(*put_args, **put_kwargs) for a in self._actors]
            return self._future(name, list(range(self.world_size)), refs, lambda values: values)
        layout = self.dp_layout()
        per_dp, pad_size = split_args_for_dp(args, kwargs, dp_size=layout.dp_size)
        # One object-store copy per chunk, shared by the ranks of an SP group (top-level refs are resolved).
        per_dp_refs = [_put_data(a, kw) for a, kw in per_dp]
        refs = []
        for rank, actor in enumerate(self._actors):
            chunk_args, chunk_kwargs = per_dp_refs[layout.dp_rank_of(rank)]
            refs.append(getattr(actor, name).remote(*chunk_args, **chunk_kwargs))

        def finish(values: list[Any]) -> DataProto:
            return collect_dp_outputs(values, layout, pad_size=pad_size, method=name)

        return self._future(name, list(range(self.world_size)), refs, finish)

    def dp_layout(self) -> DPLayout:
        """The DP position of every rank, read from the workers' ``dp_info`` on first use and cached."""
        if self._dp_layout is None:
            self._dp_layout = DPLayout(tuple(self.call("dp_info")))
        return self._dp_layout

    def shutdown(self) -> None:
        """Kill every actor and release the pool's bundles if no other group holds them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead, or Ray is shut down
                pass
        self._pool.release(self)

    def __enter__(self) -> RayWorkerGroup[W]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "alive"
        return (
            f"RayWorkerGroup({self.name_prefix!r}, {self.worker_cls.__name__}, world_size={self.world_size}, {state})"
        )

    def _resolve(self, method: Callable[..., Any] | str) -> tuple[str, DispatchSpec]:
        return resolve_method(self.worker_cls, method, role=self.name_prefix, registered=self._registered)

    def _future(self, name: str, ranks: list[int], refs: list[Any], finish: Callable[[list[Any]], Any]) -> GroupFuture:
        pending = _Pending(
            role=self.name_prefix, method=name, refs=refs, ranks=ranks, finish=finish, abort=self.shutdown
        )
        return GroupFuture(pending, poll_interval_s=self._poll_interval_s, failure_grace_s=self._failure_grace_s)

    def _create_actors(self, slots: list[Any], worker_kwargs: dict[str, Any], share: float) -> list[Any]:
        remote_cls = ray.remote(self.worker_cls)
        bundle = self._pool.bundle
        actors = []
        for slot in slots:
            ctx = RankContext(rank=slot.rank, world_size=len(slots), local_rank=slot.local_rank)
            options = remote_cls.options(
                num_cpus=bundle["CPU"] * share,
                num_gpus=bundle.get("GPU", 0.0) * share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_index
                ),
                max_restarts=0,
            )
            actors.append(options.remote(ctx, **worker_kwargs))
        return actors

    def _init_process_group(self, backend: str, timeout_s: float) -> str:
        # Construction errors surface here: the first call on an actor waits for its __init__.
        # Names, not Worker.<method>: a subclass may override these.
        try:
            ips = self.call_async("get_node_ip").result(timeout_s=timeout_s)
        except WorkerGroupError as err:  # the first call waits for __init__: name the real culprit
            raise WorkerGroupError(err.role, err.rank, "__init__", err.cause, err.failed_ranks) from err.cause
        # All ranks on one node: rendezvous over loopback; otherwise on rank 0's node IP (port probed
        # on every interface, where torch's TCPStore listens).
        master_addr = "127.0.0.1" if len(set(ips)) == 1 else ips[0]
        port_future = self.call_async("get_free_port", "127.0.0.1" if master_addr == "127.0.0.1" else "")
        master_port = port_future.result(timeout_s=timeout_s)[0]
        future = self.call_async("init_process_group", backend, master_addr=master_addr, master_port=master_port)
        resolved = str(future.result(timeout_s=timeout_s)[0])
        nodes = self.call_async("get_node_id").result(timeout_s=timeout_s)
        _log.info(
            "[%s] %s process group of %d rank(s) across %d node(s) (rendezvous %s:%d); rank -> node: %s",
            self.name_prefix,
            resolved,
            len(nodes),
            len(set(nodes)),
            master_addr,
            master_port,
            ", ".join(f"{rank}:{node}" for rank, node in enumerate(nodes)),
        )
        return resolved


def _put_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Replace every ``DataProto`` argument by a reference to one object-store copy of it."""
    put = [ray.put(a) if isinstance(a, DataProto) else a for a in args]
    return put, {k: ray.put(v) if isinstance(v, DataProto) else v for k, v in kwargs.items()}
