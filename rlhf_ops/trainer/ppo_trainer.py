"""The controller loop (verl's dataflow): generate → reward → old_log_prob → ref → values → advantages →
update_critic → update_actor, one timer per stage, metrics under verl's names.

Notation: B = sequences of a step (prompts x n), R = response length.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from rlhf_ops.agent.metrics import ROW_KEYS
from rlhf_ops.algorithms import KLController
from rlhf_ops.config.batch_plan import BatchPlan, PPOPlan
from rlhf_ops.config.schema import AlgorithmConfig, RunConfig
from rlhf_ops.data.dataset import PromptLoader
from rlhf_ops.protocol import DataProto
from rlhf_ops.tracking.logger import MetricLogger
from rlhf_ops.trainer.advantage import apply_reward_kl, build_kl_controller, compute_advantage
from rlhf_ops.trainer.dynamic_sampling import ScoredBatch, fill_dynamic_batch
from rlhf_ops.trainer.generation import merge_generation
from rlhf_ops.trainer.metrics import (
    compute_data_metrics,
    compute_reward_metrics_by_source,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    log_profile_traces,
)
from rlhf_ops.trainer.reward import RewardStage
from rlhf_ops.trainer.roles import ActorRolloutRef, Checkpointer, Critic, Tokenizer
from rlhf_ops.trainer.timing import StageTimer
from rlhf_ops.trainer.validation import validate

# Called after each committed checkpoint with (step, local checkpoint dir): remote sync, events.
CheckpointCallback = Callable[[int, str], None]


@dataclass
class TrainerState:
    """Everything beyond model/optimizer weights that resume needs (saved as JSON)."""

    global_step: int = 0
    loader: dict[str, int] = field(default_factory=dict)
    kl_ctrl: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)


def balance_tokens_across_ranks(batch: DataProto, *, dp_size: int) -> tuple[DataProto, float]:
    """Reorders rows so each data-parallel chunk holds about the same number of tokens (verl's
    ``_balance_batch``); returns the batch and max/min tokens per rank after balancing."""
    from rlhf_ops.seqlen_balancing import balance_batch_across_dp

    mask = batch.tensors["attention_mask"]
    if dp_size <= 1 or len(batch) % dp_size:
        return batch, 1.0
    balanced = batch.reorder(balance_batch_across_dp(mask, dp_size))
    per_rank = balanced.tensors["attention_mask"].sum(-1).view(dp_size, -1).sum(-1).float()
    return balanced, (per_rank.max() / per_rank.min().clamp(min=1)).item()


def needs_old_log_prob(algorithm: AlgorithmConfig, plan: PPOPlan) -> bool:
    """Whether a step needs the actor's separate old-log-prob forward before the update.

    Not when the update is on-policy (one PPO epoch of one mini-batch: every forward runs before the only
    optimizer step, so the update uses its own detached log-probs, as verl and TRL do), unless the KL
    penalty in the reward needs them before the update.
    """
    on_policy = plan.ppo_epochs == 1 and plan.num_mini_batches == 1
    return algorithm.use_kl_in_reward or not on_policy


def _add_worker_timing(timer: StageTimer, out: DataProto) -> None:
    """``timing_s/worker/<name>``: seconds a worker spent computing (rank 0's), vs the stage's wall time."""
    for name, seconds in (out.meta_info.get("timing") or {}).items():
        timer.add(f"worker/{name}", float(seconds))


class PPOTrainer:
    """Drives the worker groups through ``fit()``; holds no model, only the dataflow."""

    def __init__(
        self,
        config: RunConfig,
        plan: BatchPlan,
        *,
        actor_rollout_ref: ActorRolloutRef,
        critic: Critic | None,
        reward: RewardStage,
        train_loader: PromptLoader,
        val_loader: PromptLoader | None,
        logger: MetricLogger,
        tokenizer: Tokenizer,
        checkpointer: Checkpointer | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.config, self.plan = config, plan
        self.actor_rollout_ref, self.critic, self.reward = actor_rollout_ref, critic, reward
        self.train_loader, self.val_loader = train_loader, val_loader
        self.logger, self.tokenizer, self.checkpointer = logger, tokenizer, checkpointer
        # Every id that ends a response (rlhf_ops.models.generation.eos_token_ids); default: the tokenizer's.
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids else [int(tokenizer.eos_token_id)]
        self.kl_ctrl: KLController = build_kl_controller(config.algorithm.kl_ctrl)
        self.state = TrainerState()
        steps_per_epoch = len(train_loader)
        total = config.trainer.total_epochs * steps_per_epoch
        if config.trainer.total_training_steps is not None:
            total = min(total, config.trainer.total_training_steps)
        self.total_steps = total
        self.needs_old_log_prob = needs_old_log_prob(config.algorithm, plan.actor)

    # ---- stages -------------------------------------------------------------------------------
    def _sampling_meta(self) -> dict[str, Any]:
        r = self.config.rollout
        return {
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "do_sample": True,
            "response_length": r.max_new_tokens,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": int(self.tokenizer.pad_token_id),
            "recompute_log_prob": False,  # its own stage in step(), and only when needed
        }

    def generate(self, prompts: DataProto, timer: StageTimer) -> DataProto:
        """n samples per prompt (rows repeated interleaved, so group ids stay adjacent) + old log-probs."""
        prompts.meta_info.update(self._sampling_meta())  # type: ignore[typeddict-item]
        if self.config.algorithm.adv_estimator == "remax":
            with timer.stage("gen_max"):
                baseline = self._greedy_baseline(prompts)
        repeated = prompts.repeat(self.config.rollout.n, interleave=True)
        with timer.stage("gen"):
            out = self.actor_rollout_ref.generate_sequences(repeated)
        _add_worker_timing(timer, out)
        batch = merge_generation(repeated, out, keys=_gen_keys(out))
        if self.config.algorithm.adv_estimator == "remax":
            batch.tensors["reward_baselines"] = baseline.repeat_interleave(self.config.rollout.n)
        return batch

    def _greedy_baseline(self, prompts: DataProto) -> torch.Tensor:
        keys = ["input_ids", "attention_mask", "position_ids"]
        greedy = prompts.select(batch_keys=[*keys, *(k for k in _MEDIA_KEYS if k in prompts.tensors.keys())])
        greedy.non_tensor_batch = dict(prompts.non_tensor_batch)
        greedy.meta_info.update({**self._sampling_meta(), "do_sample": False, "recompute_log_prob": False})  # type: ignore[typeddict-item]
        generated = self.actor_rollout_ref.generate_sequences(greedy)
        out = merge_generation(greedy, generated, keys=_gen_keys(generated))
        self.reward(out)
        return out.tensors["token_level_scores"].sum(-1)

    def step(self, batch: DataProto) -> dict[str, float]:
        """One training step on a batch of prompts; returns its metrics."""
        timer, metrics = StageTimer(), dict[str, float]()
        start = time.perf_counter()
        batch = self.generate(batch, timer)
        if self.config.trainer.balance_batch:
            batch, imbalance = balance_tokens_across_ranks(batch, dp_size=self.plan.actor.mesh.dp_size)
            metrics["perf/dp_token_imbalance"] = imbalance
        with timer.stage("reward"):
            extra = self.reward(batch)
        scores = batch.tensors["token_level_scores"].sum(-1)
        metrics.update(
            compute_reward_metrics_by_source(
                scores, list(batch.non_tensor_batch["data_source"]), prefix="train", extra=extra
            )
        )
        if self.config.algorithm.filter_groups.enable:  # DAPO: refill zero-variance groups from the next prompts
            batch = self._dynamic_sampling(ScoredBatch(batch, extra), timer, metrics)
        if self.needs_old_log_prob:
            with timer.stage("old_log_prob"):
                old = self.actor_rollout_ref.compute_log_prob(batch)
            _add_worker_timing(timer, old)
            batch = batch.union(old.select(batch_keys=["old_log_probs"], meta_info_keys=[]))
            # The engine's log-probs against the actor's recompute (skipped pass: the update reports it from
            # its first forward). Engines report temperature-1 ("raw") log-probs while old_log_probs use the
            # rollout temperature, so they compare only at temperature 1.
            if "rollout_log_probs" in batch.tensors.keys() and self.config.rollout.temperature == 1.0:
                b = batch.tensors
                metrics.update(
                    compute_rollout_probs_diff(b["rollout_log_probs"], b["old_log_probs"], b["response_mask"])
                )
        if self.config.needs_ref:
            with timer.stage("ref"):
                ref = self.actor_rollout_ref.compute_ref_log_prob(batch)
            _add_worker_timing(timer, ref)
            batch = batch.union(ref.select(batch_keys=["ref_log_prob"], meta_info_keys=[]))
        if self.critic is not None:
            with timer.stage("values"):
                batch = batch.union(self.critic.compute_values(batch).select(batch_keys=["values"]))
        with timer.stage("adv"):
            metrics.update(apply_reward_kl(batch, self.config.algorithm, self.kl_ctrl))
            compute_advantage(batch, self.config.algorithm)
        if self.critic is not None:
            with timer.stage("update_critic"):
                metrics.update(self.critic.update_critic(batch))
        with timer.stage("update_actor"):
            metrics.update(self.actor_rollout_ref.update_actor(batch))
        step_seconds = time.perf_counter() - start
        metrics.update(
            compute_data_metrics(
                batch, max_response_length=self.plan.max_response_length, use_critic=self.critic is not None
            )
        )
        metrics.update(timer.metrics())
        num_tokens = int(batch.tensors["attention_mask"].sum().item())
        metrics.update(
            compute_throughput_metrics(
                num_tokens=num_tokens, step_seconds=step_seconds, world_size=self.plan.world_size
            )
        )
        return metrics

    def _dynamic_sampling(self, first: ScoredBatch, timer: StageTimer, metrics: dict[str, float]) -> DataProto:
        """The step's batch of informative groups (rlhf_ops.trainer.dynamic_sampling); ``train/<source>/*``
        reward metrics stay those of the step's own prompts (an unbiased sample of the policy)."""
        step = first.batch.meta_info.get("global_steps")

        def next_round() -> ScoredBatch:
            prompts = self.train_loader.next_batch()
            if step is not None:
                prompts.meta_info["global_steps"] = step
            batch = self.generate(prompts, timer)
            with timer.stage("reward"):
                extra = self.reward(batch)
            return ScoredBatch(batch, extra)

        cfg = self.config.algorithm.filter_groups
        batch, ds_metrics = fill_dynamic_batch(
            first,
            next_round,
            num_groups=self.config.data.train_batch_size,
            metric=cfg.metric,
            max_rounds=cfg.max_num_gen_batches,
            pad_token_id=int(self.tokenizer.pad_token_id),
        )
        metrics.update(ds_metrics)
        if self.config.trainer.balance_batch:  # the rows changed: balance them again
            batch, metrics["perf/dp_token_imbalance"] = balance_tokens_across_ranks(
                batch, dp_size=self.plan.actor.mesh.dp_size
            )
        return batch

    # ---- loop ---------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        return validate(
            self.actor_rollout_ref,
            self.val_loader,
            reward=self.reward,
            sampling=self.config.rollout.val_kwargs,
            response_length=self.config.rollout.max_new_tokens,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
        )

    def fit(self) -> TrainerState:
        """Runs from the current state (0, or a resumed step) to ``total_steps``."""
        cfg = self.config.trainer
        if self.checkpointer is not None:
            self.checkpointer.maybe_resume(self)
        if cfg.val_before_train and self.state.global_step == 0:
            self.logger.log_metrics(self.validate(), step=0)
        bar = tqdm(total=self.total_steps, initial=self.state.global_step, desc="rlhf", dynamic_ncols=True)
        while self.state.global_step < self.total_steps:
            step = self.state.global_step + 1
            batch = self.train_loader.next_batch()
            # Rollout sampling and the actor's mini-batch shuffle are seeded from the step, not from how
            # many calls a worker has seen: a resumed run redoes exactly the uninterrupted run's steps.
            batch.meta_info["global_steps"] = step
            metrics = self.step(batch)
            metrics["training/global_step"] = float(step)
            metrics["training/epoch"] = float(self.train_loader.epoch)
            self.state.global_step = step
            if cfg.test_freq and (step % cfg.test_freq == 0 or step == self.total_steps):
                metrics.update(self.validate())
            self.state.history.append({k: metrics[k] for k in _HISTORY_KEYS if k in metrics})
            self.logger.log_metrics(metrics, step=step)
            if step in cfg.profile_steps:  # the workers traced this step: attach their files to the run
                log_profile_traces(self.logger, os.path.abspath(cfg.profile_dir), step=step)
            bar.set_postfix(reward=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
            bar.update(1)
            is_last = step == self.total_steps
            if self.checkpointer is not None and ((cfg.save_freq and step % cfg.save_freq == 0) or is_last):
                self.checkpointer.save(self)
        bar.close()
        if self.checkpointer is not None:
            self.checkpointer.finish()
        return self.state

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.state.loader = self.train_loader.state_dict()
        self.state.kl_ctrl = dict(self.kl_ctrl.state_dict())
        self.state.rng = {"torch": torch.random.get_rng_state().tolist()}
        return {
            "global_step": self.state.global_step,
            "loader": self.state.loader,
            "kl_ctrl": self.state.kl_ctrl,
            "rng": self.state.rng,
            "history": self.state.history,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = TrainerState(
            global_step=int(state["global_step"]),
            loader=dict(state["loader"]),
            kl_ctrl=dict(state["kl_ctrl"]),
            rng=dict(state.get("rng", {})),
            history=list(state.get("history", [])),
        )
        self.train_loader.load_state_dict(self.state.loader)
        self.kl_ctrl.load_state_dict(self.state.kl_ctrl)
        if "torch" in self.state.rng:
            torch.random.set_rng_state(torch.tensor(self.state.rng["torch"], dtype=torch.uint8))


_GEN_KEYS = [
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
]
MULTI_TURN_KEYS = ROW_KEYS  # multi-turn rollouts: per-row turn / tool counters (rlhf_ops.agent.metrics)
_MEDIA_KEYS = ["pixel_values"]  # vision-language batches: the images travel with their rows to every role


def _gen_keys(generated: DataProto) -> list[str]:
    """The generation keys to keep: :data:`_GEN_KEYS` plus the media keys the engine returned."""
    present = set(generated.tensors.keys())
    return _GEN_KEYS + [k for k in (*_MEDIA_KEYS, *MULTI_TURN_KEYS) if k in present]


_HISTORY_KEYS = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"]
