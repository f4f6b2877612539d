"""Building an ``ActorRolloutRefWorker`` group on the session's Ray cluster, shared by integration tests."""

from __future__ import annotations

from rlhf_ops.config import RunConfig, derive_batch_plan
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefSpec, ActorRolloutRefWorker, Role
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker_group import RayWorkerGroup


def start_actor_group(
    model_dir: str,
    config: RunConfig,
    *,
    role: Role = "actor_rollout_ref",
    name: str = "actor_rollout_ref",
    pool_name: str = "test",
    steps_per_epoch: int = 10,
) -> tuple[RayResourcePool, RayWorkerGroup[ActorRolloutRefWorker]]:
    """One rank per ``config.resources.nproc_per_node`` (0.5 CPU each), models initialised."""
    world = config.resources.nproc_per_node
    spec = ActorRolloutRefSpec(
        role=role,
        model_path=model_dir,
        model=config.model,
        actor=config.actor,
        ref=config.ref,
        rollout=config.rollout,
        algorithm=config.algorithm,
        plan=derive_batch_plan(config, steps_per_epoch=steps_per_epoch),
        pad_token_id=0,
        eos_token_id=2,
        seed=3,
        device="cpu",
    )
    pool = RayResourcePool([world], use_gpu=False, num_cpus_per_process=0.5, name_prefix=pool_name)
    group = RayWorkerGroup(pool, ActorRolloutRefWorker, worker_kwargs={"spec": spec}, name_prefix=name)
    group.call(ActorRolloutRefWorker.init_model)
    return pool, group
