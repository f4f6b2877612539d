"""RayWorkerGroup on a real local Ray cluster (2 CPUs): gloo collectives, DP dispatch, colocation, failures."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import ray
import torch
import torch.distributed as dist

from rlhf_ops.protocol import DataProto
from workers.single_controller import (
    Dispatch,
    RankContext,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerGroupError,
    register,
    wait_all,
)

# tests/conftest.py: one Ray cluster per session, ray.init(num_cpus=2, include_dashboard=False), shut down at the end.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

# Ray workers import classes by module name, and this test module is importable only from the
# paths pytest set up in the driver; ship the worker classes below by value instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _RankWorker(Worker):
    """A tiny SPMD worker: every method uses the default (gloo) process group or the rank."""

    def __init__(self, ctx: RankContext, *, offset: float = 0.0, sp_size: int = 1, fail_init_rank: int = -1) -> None:
        super().__init__(ctx)
        if ctx.rank == fail_init_rank:
            raise RuntimeError(f"cannot load the model on rank {ctx.rank}")
        self.offset = offset
        if sp_size > 1:
            self.set_sequence_parallel_size(sp_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self, scale: float) -> float:
        value = torch.tensor([(self.rank + 1) * scale + self.offset])
        dist.all_reduce(value)
        return float(value.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def master_port(self) -> str:
        return os.environ["MASTER_PORT"]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto) -> DataProto:
        assert data.batch is not None
        x = data.batch["x"]
        return DataProto.from_dict({"y": x + self.rank}, non_tensors={"uid": data.non_tensor_batch["uid"]})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def slow_rank(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int, how: str) -> float:
        """``rank`` exits (``how="exit"``) or raises (``how="raise"``) while the others wait in an all_reduce."""
        if self.rank == rank:
            time.sleep(1.0)  # let the peers enter their wait first
            if how == "raise":
                raise ValueError(f"boom on rank {rank}")
            os._exit(1)
        value = torch.ones(1)
        dist.all_reduce(value)
        return float(value.item())

    def not_registered(self) -> int:
        return 0


def _batch(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)}, non_tensors={"uid": list(range(n))})


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    """PIDs still running (zombies count as gone) after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


Groups = dict[str, RayWorkerGroup[_RankWorker]]


class TestColocatedGroups:
    """Two roles of 2 ranks each on one pool of 2 one-CPU bundles (0.5 CPU per actor)."""

    @pytest.fixture(scope="class")
    def groups(self) -> Iterator[Groups]:
        roles = {
            "actor_rollout_ref": (_RankWorker, {}),  # plain data parallel: dp 2
            "critic": (_RankWorker, {"offset": 10.0, "sp_size": 2}),  # one SP group of 2 ranks: dp 1
        }
        with RayResourcePool([2], use_gpu=False, num_cpus_per_process=1.0, name_prefix="t_coloc") as pool:
            # a pending (unplaceable) actor would hit the 60 s start-up limit instead of hanging
            # as the launcher builds them: one group per role on the same bundles, 1/len(roles) of each
            groups = {
                role: RayWorkerGroup(
                    pool,
                    cls,
                    worker_kwargs=kwargs,
                    name_prefix=role,
                    backend="gloo",
                    resource_share=1.0 / len(roles),
                    init_timeout_s=60,
                )
                for role, (cls, kwargs) in roles.items()
            }
            yield groups
            for group in groups.values():
                group.shutdown()
        assert _cpus_freed(), "the pool's placement group was not removed"

    def test_all_reduce_over_gloo_in_separate_process_groups(self, groups: Groups) -> None:
        actor, critic = groups["actor_rollout_ref"], groups["critic"]
        assert actor.backend == critic.backend == "gloo"
        # actor: rank 0 sends 1 * 2.0, rank 1 sends 2 * 2.0 -> 6.0; critic adds offset 10 per rank -> 26.0
        assert actor.call(_RankWorker.all_reduce_rank, 2.0) == [6.0, 6.0]
        assert critic.call(_RankWorker.all_reduce_rank, 2.0) == [26.0, 26.0]
        assert actor.call("master_port")[0] != critic.call("master_port")[0]

    def test_four_actors_fit_in_the_two_bundles(self, groups: Groups) -> None:
        # the pool's bundles hold 2 CPUs; the 4 actors (0.5 CPU each) use them and take nothing more
        assert _free_cpus() == float(ray.cluster_resources()["CPU"]) - 2.0
        assert [g.world_size for g in groups.values()] == [2, 2]

    def test_dp_compute_proto_round_trip_keeps_order(self, groups: Groups) -> None:
        # batch 5 over dp 2: rank 0 gets rows [0 1 2], rank 1 rows [3 4 0(pad)]; y = x + rank, pad dropped
        out = groups["actor_rollout_ref"].call(_RankWorker.add_rank, _batch(5))
        assert isinstance(out, DataProto) and out.batch is not None
        assert out.batch["y"].tolist() == [0.0, 1.0, 2.0, 4.0, 5.0]
        assert out.non_tensor_batch["uid"].tolist() == [0, 1, 2, 3, 4]

    def test_sequence_parallel_ranks_share_the_batch_and_one_result_is_kept(self, groups: Groups) -> None:
        # critic: dp 1, both ranks get all 5 rows; only rank 0 (sp_rank 0) is collected, so y = x + 0
        out = groups["critic"].call(_RankWorker.add_rank, _batch(5))
        assert out.batch["y"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]

    def test_sync_and_async_calls_across_groups(self, groups: Groups) -> None:
        actor, critic = groups["actor_rollout_ref"], groups["critic"]
        assert actor.call("whoami") == [0, 1]
        future = actor.call(_RankWorker.slow_rank, 0.2)  # registered blocking=False -> a future
        other = critic.call_async(_RankWorker.all_reduce_rank, 1.0)  # (1 + 10) + (2 + 10) = 23
        assert wait_all([future, other], timeout_s=60) == [[0, 1], [23.0, 23.0]]
        assert future.done() and future.result() == [0, 1]

    def test_unregistered_method_fails_at_the_call_site(self, groups: Groups) -> None:
        critic = groups["critic"]
        with pytest.raises(AttributeError, match=r"not_registered is not decorated with @register.*\[critic\]"):
            critic.call("not_registered")
        assert not critic.closed  # nothing was sent: the group is still usable
        assert critic.call(_RankWorker.whoami) == [0, 1]


def _free_cpus() -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def _cpus_freed(timeout_s: float = 10.0) -> bool:
    """Whether every CPU of the cluster is free again (placement groups removed) within ``timeout_s``."""
    total = float(ray.cluster_resources()["CPU"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _free_cpus() >= total - 1e-6:
            return True
        time.sleep(0.2)
    return False


# "exit": rank 1's process exits (os._exit) while rank 0 waits in a gloo all_reduce.
# "raise": rank 1 raises; its process lives on, so rank 0 stays blocked in the all_reduce (as with NCCL)
# until the driver kills the group.
@pytest.mark.parametrize("how", ["exit", "raise"])
def test_failed_rank_raises_named_error_and_kills_the_group(how: str) -> None:
    pool = RayResourcePool([2], use_gpu=False, name_prefix=f"t_fail_{how}")
    group = RayWorkerGroup(pool, _RankWorker, name_prefix="critic", backend="gloo", init_timeout_s=90)
    pids = group.call(_RankWorker.get_pid)
    start = time.monotonic()
    with pytest.raises(WorkerGroupError) as info:
        group.call(_RankWorker.fail_on, 1, how)
    elapsed = time.monotonic() - start
    err = info.value
    assert (err.role, err.rank, err.method) == ("critic", 1, "fail_on")
    # A rank that died is named with its node and pid (the process is gone: no traceback of its own).
    named = re.match(r"\[critic\] rank 1 (?:on node (\S+) \(pid (\d+)\) )?failed in fail_on\(\)", str(err))
    assert named is not None, str(err)
    if how == "exit":
        assert named.group(1) and int(named.group(2)) == pids[1], str(err)
    expected = ray.exceptions.RayTaskError if how == "raise" else ray.exceptions.RayActorError
    assert isinstance(err.cause, expected) and err.__cause__ is err.cause
    if how == "raise":
        assert "boom on rank 1" in str(err)
    assert elapsed < 30.0, f"failure took {elapsed:.1f}s to surface"
    assert group.closed
    assert _wait_gone(pids) == [], "worker processes outlived the failed group"
    with pytest.raises(WorkerGroupError, match="shut down"):
        group.call(_RankWorker.whoami)
    assert _cpus_freed(), "the placement group was not removed"


def test_call_timeout_shuts_the_group_down() -> None:
    pool = RayResourcePool([1], use_gpu=False, name_prefix="t_timeout")  # one rank is enough here
    with RayWorkerGroup(pool, _RankWorker, name_prefix="reward", backend="gloo", init_timeout_s=90) as group:
        pids = group.call(_RankWorker.get_pid)
        with pytest.raises(WorkerGroupError, match=r"\[reward\] worker group failed in slow_rank\(\): timed out"):
            group.call(_RankWorker.slow_rank, 60.0).result(timeout_s=1.0)
        assert group.closed
        assert _wait_gone(pids) == []


def test_constructor_failure_names_rank_and_releases_the_pool() -> None:
    pool = RayResourcePool([2], use_gpu=False, name_prefix="t_init")
    expected = r"(?s)^\[critic\] rank 1 failed in __init__\(\).*cannot load the model on rank 1"
    with pytest.raises(WorkerGroupError, match=expected):
        RayWorkerGroup(pool, _RankWorker, worker_kwargs={"fail_init_rank": 1}, name_prefix="critic", init_timeout_s=90)
    assert _cpus_freed(), "the placement group was not removed"


def test_a_pool_on_a_full_cluster_waits_for_the_run_holding_it() -> None:
    """Two runs on one cluster: the second's bundles are granted once the first releases them, within the timeout."""
    import threading

    first = RayResourcePool([2], use_gpu=False, name_prefix="t_run_a")  # both CPUs of the session's cluster
    first.acquire(first)
    # A short timeout fails with a message naming the knob that makes a queued run wait longer.
    short = RayResourcePool([1], use_gpu=False, name_prefix="t_run_b", ready_timeout_s=1.0)
    with pytest.raises(TimeoutError, match=r"'t_run_b' could not reserve .* resources\.placement_timeout_s"):
        short.acquire(short)
    queued = RayResourcePool([1], use_gpu=False, name_prefix="t_run_b", ready_timeout_s=90.0)
    granted: list[float] = []
    waiter = threading.Thread(target=lambda: (queued.acquire(queued), granted.append(time.monotonic())))
    waiter.start()
    time.sleep(8.0)  # past the pool's 5 s notice: it is still waiting, not failed
    assert not granted and waiter.is_alive()
    released = time.monotonic()
    first.release(first)
    waiter.join(timeout=60)
    try:
        assert granted and granted[0] >= released  # granted after the first run let go, not before
    finally:
        queued.shutdown()
    assert _cpus_freed()
