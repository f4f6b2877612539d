"""``Worker``: the base class of every Ray actor that is one rank of a ``torch.distributed`` group.

A worker author subclasses :class:`Worker`, takes a :class:`RankContext` as the first constructor
argument and passes it to ``super().__init__``, and decorates the methods the driver may call with
``@register(dispatch_mode=...)``. ``RayWorkerGroup`` creates one actor per rank, then calls
:meth:`Worker.init_process_group` on every rank before any user method.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_ops.trainer import determinism
from workers.preemption import install_rank_handler
from workers.single_controller.decorator import Dispatch, register
from workers.single_controller.dispatch import DPRankInfo, sequence_parallel_rank_info

__all__ = ["RankContext", "Worker", "get_free_port", "get_node_ip", "resolve_backend"]

_BACKENDS = ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl")


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Where one worker process sits in its group; given to the worker's constructor."""

    rank: int
    """Global rank in ``[0, world_size)``."""
    world_size: int
    """Number of ranks in the group."""
    local_rank: int = 0
    """Index of this rank among the group's ranks on the same node (selects the GPU)."""
    master_addr: str | None = None
    """Address of rank 0's rendezvous store; may be given later to ``init_process_group``."""
    master_port: int | None = None
    """Port of rank 0's rendezvous store; may be given later to ``init_process_group``."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size}).")
        if self.local_rank < 0:
            raise ValueError(f"local_rank={self.local_rank} must be >= 0.")

    @classmethod
    def from_env(cls) -> RankContext:
        """Read ``RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT`` (as torchrun sets them).

        Raises:
            ValueError: If ``RANK`` or ``WORLD_SIZE`` is unset.
        """
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise ValueError(f"{missing} not set; pass a RankContext to the worker or set them in the environment.")
        port = os.environ.get("MASTER_PORT")
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            master_addr=os.environ.get("MASTER_ADDR"),
            master_port=int(port) if port else None,
        )


def resolve_backend(backend: str, *, cuda_available: bool) -> str:
    """Map the requested backend to the one ``init_process_group`` gets.

    ``"auto"`` is gloo on CPU and ``"cpu:gloo,cuda:nccl"`` on GPU (NCCL for CUDA tensors, gloo for
    CPU tensors, so e.g. a CPU-side ``all_gather_object`` still works). ``"nccl"`` also becomes the
    mixed backend; it is an error without CUDA (rather than a silent, much slower gloo run).

    Raises:
        ValueError: If ``backend`` is unknown, or NCCL is asked for without CUDA.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS}.")
    if backend == "auto":
        return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"
    if backend in ("nccl", "cpu:gloo,cuda:nccl"):
        if not cuda_available:
            raise ValueError(f"backend={backend!r} needs CUDA, which this worker lacks; use backend='auto' or 'gloo'.")
        return "cpu:gloo,cuda:nccl"
    return backend


def get_node_ip() -> str:
    """IP address of this node as Ray sees it (``127.0.0.1`` outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def get_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; it may be taken later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class Worker:
    """Base class of a rank: knows its place in the group and creates the default process group.

    Subclasses keep ``RankContext`` as their first constructor argument::

        class CriticWorker(Worker):
            def __init__(self, ctx: RankContext, *, lr: float) -> None:
                super().__init__(ctx)
                self.lr = lr
    """

    def __init__(self, ctx: RankContext | None = None) -> None:
        self.ctx = ctx if ctx is not None else RankContext.from_env()
        self._dp_info = DPRankInfo(dp_rank=self.ctx.rank, dp_size=self.ctx.world_size, is_collect_rank=True)
        env: dict[str, int | str] = {
            "RANK": self.ctx.rank,
            "WORLD_SIZE": self.ctx.world_size,
            "LOCAL_RANK": self.ctx.local_rank,
        }
        if self.ctx.master_addr is not None:
            env["MASTER_ADDR"] = self.ctx.master_addr
        if self.ctx.master_port is not None:
            env["MASTER_PORT"] = self.ctx.master_port
        # Each Ray actor owns its process, so setting the environment does not leak into other ranks.
        os.environ.update({k: str(v) for k, v in env.items()})
        determinism.apply_from_env()  # trainer.deterministic: before the worker builds anything
        # A training run's rank (RLHF_PREEMPTION_GRACE_S set): a SIGTERM to it, as when its node is drained, becomes
        # the run's preemption notice instead of killing it (workers/preemption.py).
        install_rank_handler(f"rank {self.ctx.rank} of {type(self).__name__} on node {get_node_ip()}")

    @property
    def rank(self) -> int:
        """Global rank of this worker."""
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in this worker's group."""
        return self.ctx.world_size

    def set_sequence_parallel_size(self, sp_size: int) -> None:
        """Declare that consecutive groups of ``sp_size`` ranks share one DP chunk (Ulysses SP).

        Call it in the constructor or ``init_model``, before the driver's first
        ``DP_COMPUTE_PROTO`` call: the group reads :meth:`dp_info` once and caches it.
        """
        self._dp_info = sequence_parallel_rank_info(self.rank, world_size=self.world_size, sp_size=sp_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def dp_info(self) -> DPRankInfo:
        """This rank's position in the DP split (read by the driver for ``DP_COMPUTE_PROTO``)."""
        return self._dp_info

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_node_ip(self) -> str:
        """IP address of the node this rank runs on."""
        return get_node_ip()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_node_id(self) -> str:
        """Ray node id of the node this rank runs on (two raylets on one machine share an IP, not a node id)."""
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else "local"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_free_port(self, host: str = "127.0.0.1") -> int:
        """A free TCP port on ``host`` of this rank's node (rank 0's becomes the group's master port)."""
        return get_free_port(host)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_pid(self) -> int:
        """Process id of this rank (for monitoring and tests)."""
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(
        self,
        backend: str = "auto",
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout_s: float = 1800.0,
    ) -> str:
        """Create the default ``torch.distributed`` process group of this worker's group.

        Args:
            backend: ``"auto"``, ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"`` (see :func:`resolve_backend`).
            master_addr: Rendezvous address; defaults to the one in the ``RankContext``.
            master_port: Rendezvous port; defaults to the one in the ``RankContext``.
            timeout_s: Timeout of collectives (torch's default is 30 minutes).

        Returns:
            The backend string the process group was created with.

        Raises:
            ValueError: If no master address/port is known, or the backend is not available.
        """
        if dist.is_initialized():
            return str(dist.get_backend())
        resolved = resolve_backend(backend, cuda_available=torch.cuda.is_available())
        addr = master_addr or self.ctx.master_addr
        port = master_port or self.ctx.master_port
        if addr is None or port is None:
            raise ValueError("init_process_group needs master_addr and master_port (argument, RankContext or env).")
        os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
        if torch.cuda.is_available():
            # With one GPU (or a fraction of one) per bundle Ray exposes only that GPU (count 1 -> device 0);
            # if every GPU is visible, LOCAL_RANK picks this rank's own.
            index = self.ctx.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            # vLLM's external launcher places its worker on cuda:$LOCAL_RANK. Two ranks sharing one GPU (fractional
            # Ray GPUs) both see only device 0, so rank 1's LOCAL_RANK=1 would name a device that does not exist:
            # the variable must be the index of the device this rank was given.
            os.environ["LOCAL_RANK"] = str(index)
        host = f"[{addr}]" if ":" in addr else addr
        dist.init_process_group(
            backend=resolved,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return resolved
