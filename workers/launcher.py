"""Creates the Ray resource pool and the role worker groups of one run, and tears them down.

The roles are the entries of :data:`workers.roles.WORKER_ROLES`, started in table order when the run needs them.
Colocation: every role runs on the same bundles (one per rank); each role is its own group of processes sharing
the bundle's CPUs/GPU by a fractional request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rlhf_ops.config.batch_plan import BatchPlan
from rlhf_ops.config.schema import RunConfig
from workers.clients import ActorRolloutRefClient, CriticClient, RewardModelClient
from workers.roles import RoleContext, WorkerRole, active_roles
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker import Worker
from workers.single_controller.worker_group import RayWorkerGroup


@dataclass
class RoleGroups:
    """The clients the controller uses (one per started role, by role name), and what must be shut down after."""

    clients: dict[str, Any]
    pool: RayResourcePool
    groups: list[RayWorkerGroup[Any]] = field(default_factory=list)

    @property
    def actor_rollout_ref(self) -> ActorRolloutRefClient:
        client: ActorRolloutRefClient = self.clients["actor_rollout_ref"]
        return client

    @property
    def critic(self) -> CriticClient | None:
        client: CriticClient | None = self.clients.get("critic")
        return client

    @property
    def reward_model(self) -> RewardModelClient | None:
        client: RewardModelClient | None = self.clients.get("reward_model")
        return client

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.pool.shutdown()


RoleRow = tuple[str, type[Worker], Any]


def _needed(config: RunConfig, plan: BatchPlan, ctx: RoleContext) -> list[tuple[WorkerRole, str, type[Worker], Any]]:
    """``(entry, group name, worker class, spec)`` of every role the run needs, in table order. A spec's ``role``
    field, when it has one, names the group (the actor group is ``actor_rollout`` without a reference)."""
    rows = []
    for role in active_roles():
        built = role.build(config, plan, ctx)
        if built is not None:
            worker_cls, spec = built
            rows.append((role, str(getattr(spec, "role", None) or role.name), worker_cls, spec))
    return rows


def role_table(
    config: RunConfig,
    plan: BatchPlan,
    *,
    model_path: str,
    pad_token_id: int,
    eos_token_id: int | tuple[int, ...],
    profile_steps: tuple[int, ...],
    profile_dir: str,
) -> list[RoleRow]:
    """``(group name, worker class, spec)`` of every role the config needs, in start order.

    Each spec holds the role's own sections of the config (never the root) and its part of ``plan``.
    """
    ctx = RoleContext(
        model_path=model_path,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        profile_steps=profile_steps,
        profile_dir=profile_dir,
    )
    return [(name, worker_cls, spec) for _, name, worker_cls, spec in _needed(config, plan, ctx)]


def launch_role_groups(
    config: RunConfig,
    plan: BatchPlan,
    *,
    model_path: str,
    pad_token_id: int,
    eos_token_id: int | tuple[int, ...],
) -> RoleGroups:
    """Starts the groups the config needs and calls ``init_model`` on each.

    ``plan`` must be derived with the training set's size (``steps_per_epoch``): the trained roles read their
    LR schedule's length from it.
    """
    res = config.resources
    # Absolute on the driver: Ray workers may run in another working directory (multi-node: a shared FS).
    ctx = RoleContext(
        model_path=model_path,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        profile_steps=tuple(config.trainer.profile_steps),
        profile_dir=os.path.abspath(config.trainer.profile_dir),
    )
    rows = _needed(config, plan, ctx)
    pool = RayResourcePool(
        [res.nproc_per_node] * res.nnodes,
        use_gpu=res.device == "cuda",
        num_cpus_per_process=res.num_cpus_per_worker,
        gpus_per_process=res.gpus_per_worker,
        # Placement groups of concurrent runs on one cluster are told apart (``ray status``) by experiment + run.
        name_prefix=f"{config.trainer.experiment_name}.{config.trainer.run_name}",
        # A run that finds the cluster taken by other runs waits its turn instead of failing after a minute.
        ready_timeout_s=res.placement_timeout_s,
    )
    share = 1.0 / len(rows)  # every role on every bundle (pool "colocated"), each a fraction of its CPUs / GPU
    # NCCL refuses two ranks on one device ("Duplicate GPU detected"): ranks sharing a GPU talk over gloo.
    backend = "nccl" if res.device == "cuda" and res.gpus_per_worker >= 1.0 else "gloo"
    groups: dict[str, RayWorkerGroup[Any]] = {}
    try:
        for _, name, worker_cls, spec in rows:
            groups[name] = RayWorkerGroup(
                pool,
                worker_cls,
                worker_kwargs={"spec": spec},
                name_prefix=name,
                backend=backend,
                resource_share=share,
            )
        for group in groups.values():
            group.call("init_model")
        clients = {role.name: role.wrap(groups[name], config) for role, name, _, _ in rows}
    except BaseException:
        for group in groups.values():
            group.shutdown()
        pool.shutdown()
        raise
    return RoleGroups(clients=clients, pool=pool, groups=list(groups.values()))
