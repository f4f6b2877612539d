"""Creates the Ray resource pool and the role worker groups of one run, and tears them down.

Colocation: every role runs on the same bundles (one per rank); each role is its own group of
processes sharing the bundle's CPUs/GPU by a fractional request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rlhf_ops.config.batch_plan import BatchPlan
from rlhf_ops.config.schema import RunConfig
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefSpec, ActorRolloutRefWorker, Role
from workers.actor.async_actor_rollout_ref_worker import AsyncActorRolloutRefWorker
from workers.clients import ActorRolloutRefClient, CriticClient, RewardModelClient
from workers.critic.critic_worker import CriticSpec, CriticWorker
from workers.reward_model.reward_model_worker import RewardModelSpec, RewardModelWorker
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker import Worker
from workers.single_controller.worker_group import RayWorkerGroup


@dataclass
class RoleGroups:
    """The clients the controller uses, and what must be shut down after."""

    actor_rollout_ref: ActorRolloutRefClient
    critic: CriticClient | None
    reward_model: RewardModelClient | None
    pool: RayResourcePool
    groups: list[RayWorkerGroup[Any]] = field(default_factory=list)

    def shutdown(self) -> None:
        for group in self.groups:
            group.shutdown()
        self.pool.shutdown()


RoleRow = tuple[str, type[Worker], Any]


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
    res = config.resources
    role: Role = "actor_rollout_ref" if config.needs_ref else "actor_rollout"
    # rollout.mode=async: the same worker with a vLLM AsyncLLM engine (engine core in its own process).
    actor_cls = AsyncActorRolloutRefWorker if config.rollout.mode == "async" else ActorRolloutRefWorker
    rows: list[RoleRow] = [
        (
            role,
            actor_cls,
            ActorRolloutRefSpec(
                role=role,
                model_path=model_path,
                model=config.model,
                actor=config.actor,
                ref=config.ref,
                rollout=config.rollout,
                algorithm=config.algorithm,
                plan=plan,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_id,
                seed=config.trainer.seed,
                device=res.device,
                num_threads=res.threads_per_worker,
                profile_steps=profile_steps,
                profile_dir=profile_dir,
                live_metrics="prometheus" in config.trainer.logger,
            ),
        )
    ]
    if config.needs_critic:
        assert plan.critic is not None
        critic = CriticSpec(
            model_path=config.critic.model_path or model_path,
            model=config.model,
            critic=config.critic,
            algorithm=config.algorithm,
            plan=plan.critic,
            seed=config.trainer.seed,
            device=res.device,
            profile_steps=profile_steps,
            profile_dir=profile_dir,
        )
        rows.append(("critic", CriticWorker, critic))
    if config.reward.model_path is not None:
        assert plan.reward_model is not None
        reward_model = RewardModelSpec(
            model_path=config.reward.model_path,
            micro_batch_size=config.reward.micro_batch_size_per_gpu,
            dtype=config.model.dtype,
            attn_implementation=config.model.attn_implementation,
            fsdp=config.reward.fsdp,
            mesh=plan.reward_model,
            device=res.device,
        )
        rows.append(("reward_model", RewardModelWorker, reward_model))
    return rows


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
    rows = role_table(
        config,
        plan,
        model_path=model_path,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        profile_steps=tuple(config.trainer.profile_steps),
        profile_dir=os.path.abspath(config.trainer.profile_dir),
    )
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
    share = 1.0 / len(rows)  # every role on every bundle, each a fraction of its CPUs / GPU
    # NCCL refuses two ranks on one device ("Duplicate GPU detected"): ranks sharing a GPU talk over gloo.
    backend = "nccl" if res.device == "cuda" and res.gpus_per_worker >= 1.0 else "gloo"
    groups: dict[str, RayWorkerGroup[Any]] = {}
    try:
        for name, worker_cls, spec in rows:
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
    except BaseException:
        for group in groups.values():
            group.shutdown()
        pool.shutdown()
        raise
    arr = groups.get("actor_rollout_ref", groups.get("actor_rollout"))
    assert arr is not None
    return RoleGroups(
        actor_rollout_ref=ActorRolloutRefClient(arr, watchdog_s=config.trainer.rollout_watchdog_s),
        critic=CriticClient(groups["critic"]) if "critic" in groups else None,
        reward_model=RewardModelClient(groups["reward_model"]) if "reward_model" in groups else None,
        pool=pool,
        groups=list(groups.values()),
    )
