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
from workers.clients import ActorRolloutRefClient, CriticClient, RewardModelClient
from workers.critic.critic_worker import CriticSpec, CriticWorker
from workers.reward_model.reward_model_worker import RewardModelSpec, RewardModelWorker
from workers.single_controller.resource_pool import RayResourcePool
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
    n_roles = 1 + int(config.needs_critic) + int(config.reward.model_path is not None)
    pool = RayResourcePool(
        [res.nproc_per_node] * res.nnodes,
        use_gpu=res.device == "cuda",
        num_cpus_per_process=res.num_cpus_per_worker,
        gpus_per_process=res.gpus_per_worker,
        name_prefix=config.trainer.experiment_name,
    )
    share = 1.0 / n_roles
    # Absolute on the driver: Ray workers may run in another working directory (multi-node: a shared FS).
    profiling: dict[str, Any] = {
        "profile_steps": tuple(config.trainer.profile_steps),
        "profile_dir": os.path.abspath(config.trainer.profile_dir),
    }
    # NCCL refuses two ranks on one device ("Duplicate GPU detected"): ranks sharing a GPU talk over gloo.
    backend = "nccl" if res.device == "cuda" and res.gpus_per_worker >= 1.0 else "gloo"
    groups: list[RayWorkerGroup[Any]] = []
    try:
        role: Role = "actor_rollout_ref" if config.needs_ref else "actor_rollout"
        spec = ActorRolloutRefSpec(
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
            **profiling,
        )
        arr = RayWorkerGroup(
            pool,
            ActorRolloutRefWorker,
            worker_kwargs={"spec": spec},
            name_prefix=role,
            backend=backend,
            resource_share=share,
        )
        groups.append(arr)
        critic = None
        if config.needs_critic:
            assert plan.critic is not None
            critic_spec = CriticSpec(
                model_path=config.critic.model_path or model_path,
                model=config.model,
                critic=config.critic,
                algorithm=config.algorithm,
                plan=plan.critic,
                seed=config.trainer.seed,
                device=res.device,
                **profiling,
            )
            critic_group = RayWorkerGroup(
                pool,
                CriticWorker,
                worker_kwargs={"spec": critic_spec},
                name_prefix="critic",
                backend=backend,
                resource_share=share,
            )
            groups.append(critic_group)
            critic = CriticClient(critic_group)
        reward_model = None
        if config.reward.model_path is not None:
            rm_spec = RewardModelSpec(
                model_path=config.reward.model_path,
                micro_batch_size=config.reward.micro_batch_size_per_gpu,
                dtype=config.model.dtype,
                attn_implementation=config.model.attn_implementation,
                fsdp=config.ref.fsdp,
                device=res.device,
            )
            rm_group = RayWorkerGroup(
                pool,
                RewardModelWorker,
                worker_kwargs={"spec": rm_spec},
                name_prefix="reward_model",
                backend=backend,
                resource_share=share,
            )
            groups.append(rm_group)
            reward_model = RewardModelClient(rm_group)
        for group in groups:
            group.call("init_model")
    except BaseException:
        for group in groups:
            group.shutdown()
        pool.shutdown()
        raise
    return RoleGroups(
        actor_rollout_ref=ActorRolloutRefClient(arr),
        critic=critic,
        reward_model=reward_model,
        pool=pool,
        groups=groups,
    )
