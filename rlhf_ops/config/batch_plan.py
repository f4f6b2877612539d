"""Every derived size a worker needs, computed once on the driver from config + world size.

verl normalises batch sizes in place inside each worker (six places); here the driver derives them
once, workers receive the plan and never recompute. Counts are in *sequences* unless named prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlhf_ops.config.schema import ActorConfig, CriticConfig, RunConfig


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """Device mesh of one role: ``world = dp * sp``; FSDP mesh ``(replicate, shard)`` over dp ranks."""

    world_size: int
    dp_size: int
    sp_size: int
    replicate_size: int
    shard_size: int


@dataclass(frozen=True, kw_only=True)
class PPOPlan:
    """Per-rank sizes of one trained role (actor or critic)."""

    mesh: MeshPlan
    mini_batch_size: int  # sequences per optimizer step, all ranks
    mini_batch_size_per_rank: int
    micro_batch_size_per_rank: int  # ignored when use_dynamic_bsz
    num_mini_batches: int  # optimizer steps per ppo epoch
    ppo_epochs: int
    use_dynamic_bsz: bool
    max_token_len_per_rank: int  # token budget of one micro-batch (x sp: tokens are split over sp ranks)
    log_prob_micro_batch_size_per_rank: int
    log_prob_max_token_len_per_rank: int


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """Sizes of one training step."""

    world_size: int
    rollout_n: int
    prompts_per_step: int
    sequences_per_step: int
    max_prompt_length: int
    max_response_length: int
    max_seq_len: int
    actor: PPOPlan
    critic: PPOPlan | None
    ref_log_prob_micro_batch_size_per_rank: int
    ref_log_prob_max_token_len_per_rank: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _mesh(world_size: int, sp: int, replicate: int) -> MeshPlan:
    dp = world_size // sp
    return MeshPlan(
        world_size=world_size, dp_size=dp, sp_size=sp, replicate_size=replicate, shard_size=world_size // replicate
    )


def _ppo_plan(
    cfg: ActorConfig | CriticConfig, *, world_size: int, n: int, prompts: int, ppo_epochs: int, log_prob_tokens: int
) -> PPOPlan:
    sp = cfg.ulysses_sequence_parallel_size
    # fsdp.fsdp_size (shard-group size, verl's name) and hsdp_replicate_size describe the same mesh.
    replicate = world_size // cfg.fsdp.fsdp_size if cfg.fsdp.fsdp_size > 0 else cfg.fsdp.hsdp_replicate_size
    mesh = _mesh(world_size, sp, replicate)
    mini = cfg.ppo_mini_batch_size * n
    per_rank = mini // mesh.dp_size
    micro = min(cfg.ppo_micro_batch_size_per_gpu, per_rank)
    return PPOPlan(
        mesh=mesh,
        mini_batch_size=mini,
        mini_batch_size_per_rank=per_rank,
        micro_batch_size_per_rank=micro,
        num_mini_batches=prompts // cfg.ppo_mini_batch_size,
        ppo_epochs=ppo_epochs,
        use_dynamic_bsz=cfg.use_dynamic_bsz,
        max_token_len_per_rank=cfg.ppo_max_token_len_per_gpu * sp,
        log_prob_micro_batch_size_per_rank=cfg.log_prob_micro_batch_size_per_gpu,
        log_prob_max_token_len_per_rank=log_prob_tokens * sp,
    )


def derive_batch_plan(run: RunConfig) -> BatchPlan:
    """The plan of a validated config (``check_config`` guarantees every division here is exact)."""
    n, prompts, world = run.rollout.n, run.data.train_batch_size, run.world_size
    epochs = run.algorithm.ppo_epochs
    actor = _ppo_plan(
        run.actor,
        world_size=world,
        n=n,
        prompts=prompts,
        ppo_epochs=epochs,
        log_prob_tokens=run.actor.log_prob_max_token_len_per_gpu,
    )
    critic = None
    if run.needs_critic:
        critic = _ppo_plan(
            run.critic,
            world_size=world,
            n=n,
            prompts=prompts,
            ppo_epochs=epochs,
            log_prob_tokens=run.critic.ppo_max_token_len_per_gpu,
        )
    return BatchPlan(
        world_size=world,
        rollout_n=n,
        prompts_per_step=prompts,
        sequences_per_step=prompts * n,
        max_prompt_length=run.data.max_prompt_length,
        max_response_length=run.rollout.max_new_tokens,
        max_seq_len=run.data.max_prompt_length + run.rollout.max_new_tokens,
        actor=actor,
        critic=critic,
        ref_log_prob_micro_batch_size_per_rank=run.ref.log_prob_micro_batch_size_per_gpu,
        ref_log_prob_max_token_len_per_rank=run.ref.log_prob_max_token_len_per_gpu,
    )
