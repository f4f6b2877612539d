"""The built-in worker roles' builders (the ``target`` of :data:`workers.roles.WORKER_ROLES`' entries).

Each turns the run's config and plan into ``(worker class, spec)``, or None when the run does not need the role.
A spec holds the role's own sections of the config (never the root) and its part of the plan.
"""

from __future__ import annotations

from typing import Any

from rlhf_ops.config.batch_plan import BatchPlan
from rlhf_ops.config.schema import RunConfig
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefSpec, ActorRolloutRefWorker, Role
from workers.critic.critic_worker import CriticSpec, CriticWorker
from workers.reward_model.reward_model_worker import RewardModelSpec, RewardModelWorker
from workers.roles import RoleContext


def actor_rollout_ref(config: RunConfig, plan: BatchPlan, ctx: RoleContext) -> tuple[type, Any]:
    """Always: the policy group (``actor_rollout`` without a reference). ``rollout.mode=async``: the same worker
    builds the engine's async mode (vLLM AsyncLLM, engine core in its own process)."""
    res = config.resources
    role: Role = "actor_rollout_ref" if config.needs_ref else "actor_rollout"
    spec = ActorRolloutRefSpec(
        role=role,
        model_path=ctx.model_path,
        model=config.model,
        actor=config.actor,
        ref=config.ref,
        rollout=config.rollout,
        algorithm=config.algorithm,
        plan=plan,
        pad_token_id=ctx.pad_token_id,
        eos_token_id=ctx.eos_token_id,
        seed=config.trainer.seed,
        device=res.device,
        num_threads=res.threads_per_worker,
        profile_steps=ctx.profile_steps,
        profile_dir=ctx.profile_dir,
        live_metrics="prometheus" in config.trainer.logger,
    )
    return ActorRolloutRefWorker, spec


def critic(config: RunConfig, plan: BatchPlan, ctx: RoleContext) -> tuple[type, Any] | None:
    """When the advantage estimator needs a critic."""
    if not config.needs_critic:
        return None
    assert plan.critic is not None
    spec = CriticSpec(
        model_path=config.critic.model_path or ctx.model_path,
        model=config.model,
        critic=config.critic,
        algorithm=config.algorithm,
        plan=plan.critic,
        seed=config.trainer.seed,
        device=config.resources.device,
        profile_steps=ctx.profile_steps,
        profile_dir=ctx.profile_dir,
    )
    return CriticWorker, spec


def reward_model(config: RunConfig, plan: BatchPlan, ctx: RoleContext) -> tuple[type, Any] | None:
    """When ``reward.model_path`` is set."""
    if config.reward.model_path is None:
        return None
    assert plan.reward_model is not None
    spec = RewardModelSpec(
        model_path=config.reward.model_path,
        micro_batch_size=config.reward.micro_batch_size_per_gpu,
        dtype=config.model.dtype,
        attn_implementation=config.model.attn_implementation,
        fsdp=config.reward.fsdp,
        mesh=plan.reward_model,
        device=config.resources.device,
    )
    return RewardModelWorker, spec
