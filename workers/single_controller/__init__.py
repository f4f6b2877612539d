"""Single controller: the driver drives Ray worker groups whose methods declare their dispatch.

See ``README.md`` next to this file for how to write a worker class and call it from the driver.
"""

from __future__ import annotations

from workers.single_controller.decorator import (
    Dispatch,
    DispatchSpec,
    get_dispatch_spec,
    register,
    registered_methods,
    resolve_method,
)
from workers.single_controller.dispatch import (
    DPLayout,
    DPRankInfo,
    collect_dp_outputs,
    gather_from_dp,
    sequence_parallel_rank_info,
    split_args_for_dp,
    split_for_dp,
)
from workers.single_controller.futures import GroupFuture, WorkerGroupError, wait_all
from workers.single_controller.resource_pool import BundleSlot, RayResourcePool
from workers.single_controller.worker import RankContext, Worker, get_free_port, get_node_ip, resolve_backend
from workers.single_controller.worker_group import RayWorkerGroup

__all__ = [
    "BundleSlot",
    "DPLayout",
    "DPRankInfo",
    "Dispatch",
    "DispatchSpec",
    "GroupFuture",
    "RankContext",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "WorkerGroupError",
    "collect_dp_outputs",
    "gather_from_dp",
    "get_dispatch_spec",
    "get_free_port",
    "get_node_ip",
    "register",
    "registered_methods",
    "resolve_backend",
    "resolve_method",
    "sequence_parallel_rank_info",
    "split_args_for_dp",
    "split_for_dp",
    "wait_all",
]
