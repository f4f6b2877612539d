"""Every derived size a worker needs, computed once on the driver from config + world size.

verl normalises batch sizes in place inside each worker (six places); here the driver derives them
once, workers receive the plan and never recompute. Counts are in *sequences* unless named prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlhf_ops.config.schema import ActorConfig, CriticConfig, FSDPConfig, RunConfig, TrainerConfig


def is_on_policy(ppo_epochs: int, num_mini_batches: int) -> bool:
    """One PPO epoch of one mini-batch: every forward runs before the only optimizer step, so the update
    can use its own detached log-probs as the old ones (verl and TRL do). The one place this is decided: the
    trainer, the actor, the cost model and the validation read it (through :attr:`PPOPlan.on_policy`)."""
    return ppo_epochs == 1 and num_mini_batches == 1


@dataclass(frozen=True, kw_only=True)
class MeshPlan:
    """Device mesh of one role: ``world = dp * sp``; FSDP mesh ``(replicate, shard)`` over dp ranks."""

    world_size: int
    dp_size: int
    sp_size: int
    replicate_size: int
    shard_size: int


@dataclass(frozen=True, kw_only=True)
class ForwardPlan:
    """Micro-batching of one no-grad forward pass on a rank (old log-probs, reference log-probs, values)."""

    micro_batch_size_per_rank: int  # rows per micro-batch; ignored when use_dynamic_bsz
    max_token_len_per_rank: int  # token budget of one micro-batch with dynamic batch size (x sp, see PPOPlan)
    use_dynamic_bsz: bool


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
    optimizer_steps: int | None = None
    """Optimizer steps of the whole run (the LR schedule's length): total steps x mini-batches x epochs.
    None when the plan was derived without the training set's size (``derive_batch_plan(run)`` alone)."""

    @property
    def on_policy(self) -> bool:
        """See :func:`is_on_policy`."""
        return is_on_policy(self.ppo_epochs, self.num_mini_batches)

    @property
    def log_prob(self) -> ForwardPlan:
        """The micro-batching of this role's no-grad forward (old log-probs, values)."""
        return ForwardPlan(
            micro_batch_size_per_rank=self.log_prob_micro_batch_size_per_rank,
            max_token_len_per_rank=self.log_prob_max_token_len_per_rank,
            use_dynamic_bsz=self.use_dynamic_bsz,
        )


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
    ref: ForwardPlan
    """The reference policy's log-prob forward; it runs on the actor's ranks, so under Ulysses its token
    budget carries the actor's sp factor too."""
    steps_per_epoch: int | None = None
    """Training batches per epoch (the loader drops the last partial one); None: not given."""
    total_steps: int | None = None
    """Training steps of the run (:func:`total_training_steps`); None without ``steps_per_epoch``."""
    reward_model: MeshPlan | None = None
    """The reward model's FSDP mesh (``reward.fsdp``, all ranks, no sp); None without ``reward.model_path``."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def require_optimizer_steps(plan: PPOPlan, *, role: str) -> int:
    """``plan.optimizer_steps``; a ValueError naming the fix for a plan derived without the training set's size."""
    if plan.optimizer_steps is None:
        raise ValueError(
            f"the {role}'s plan has no optimizer_steps (the LR schedule's length): derive it with "
            "derive_batch_plan(config, steps_per_epoch=len(train_loader))"
        )
    return plan.optimizer_steps


def replicate_size(fsdp: FSDPConfig, *, world_size: int) -> int:
    """HSDP replica groups of a role's FSDP mesh: ``fsdp.fsdp_size`` (shard-group size, verl's name) and
    ``fsdp.hsdp_replicate_size`` describe the same mesh (validation refuses both at once)."""
    return world_size // fsdp.fsdp_size if fsdp.fsdp_size > 0 else fsdp.hsdp_replicate_size


def _mesh(world_size: int, sp: int, replicate: int) -> MeshPlan:
    dp = world_size // sp
    return MeshPlan(
        world_size=world_size, dp_size=dp, sp_size=sp, replicate_size=replicate, shard_size=world_size // replicate
    )


def total_training_steps(trainer: TrainerConfig, *, steps_per_epoch: int) -> int:
    """``total_epochs`` x ``steps_per_epoch``, capped by ``total_training_steps``: the one rule of the trainer,
    the pre-flight's checkpoint plan and the workers' LR schedules."""
    total = trainer.total_epochs * steps_per_epoch
    if trainer.total_training_steps is not None:
        total = min(total, trainer.total_training_steps)
    return total


def _ppo_plan(
    cfg: ActorConfig | CriticConfig,
    *,
    world_size: int,
    n: int,
    prompts: int,
    ppo_epochs: int,
    log_prob_tokens: int,
    total_steps: int | None,
) -> PPOPlan:
    sp = cfg.ulysses_sequence_parallel_size
    mesh = _mesh(world_size, sp, replicate_size(cfg.fsdp, world_size=world_size))
    mini = cfg.ppo_mini_batch_size * n
    per_rank = mini // mesh.dp_size
    micro = min(cfg.ppo_micro_batch_size_per_gpu, per_rank)
    num_mini_batches = prompts // cfg.ppo_mini_batch_size
    return PPOPlan(
        mesh=mesh,
        mini_batch_size=mini,
        mini_batch_size_per_rank=per_rank,
        micro_batch_size_per_rank=micro,
        num_mini_batches=num_mini_batches,
        ppo_epochs=ppo_epochs,
        use_dynamic_bsz=cfg.use_dynamic_bsz,
        max_token_len_per_rank=cfg.ppo_max_token_len_per_gpu * sp,
        log_prob_micro_batch_size_per_rank=cfg.log_prob_micro_batch_size_per_gpu,
        log_prob_max_token_len_per_rank=log_prob_tokens * sp,
        optimizer_steps=None if total_steps is None else max(1, total_steps * num_mini_batches * ppo_epochs),
    )


def derive_batch_plan(run: RunConfig, *, steps_per_epoch: int | None = None) -> BatchPlan:
    """The plan of a validated config (``check_config`` guarantees every division here is exact).

    Args:
        run: The validated config.
        steps_per_epoch: Training batches per epoch (``len(train_loader)``). With it the plan holds the run's
            total steps and each trained role's optimizer steps; without it (``rlhf config show --plan``) those
            are None and a worker refuses the plan.
    """
    n, prompts, world = run.rollout.n, run.data.train_batch_size, run.world_size
    epochs = run.algorithm.ppo_epochs
    total = None if steps_per_epoch is None else total_training_steps(run.trainer, steps_per_epoch=steps_per_epoch)
    actor = _ppo_plan(
        run.actor,
        world_size=world,
        n=n,
        prompts=prompts,
        ppo_epochs=epochs,
        log_prob_tokens=run.actor.log_prob_max_token_len_per_gpu,
        total_steps=total,
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
            total_steps=total,
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
        ref=ForwardPlan(
            micro_batch_size_per_rank=run.ref.log_prob_micro_batch_size_per_gpu,
            # x sp like the actor's: the SP group forwards one micro-batch together, each rank 1/sp of it.
            max_token_len_per_rank=run.ref.log_prob_max_token_len_per_gpu * actor.mesh.sp_size,
            use_dynamic_bsz=run.actor.use_dynamic_bsz,
        ),
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        reward_model=None
        if run.reward.model_path is None
        else _mesh(world, 1, replicate_size(run.reward.fsdp, world_size=world)),
    )
