"""The controller loop (verl's dataflow): generate → reward → old_log_prob → ref → values → advantages →
update_critic → update_actor, one timer per stage, metrics under verl's names.

Notation: B = sequences of a step (prompts x n), R = response length.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm import tqdm

from rlhf_ops.algorithms import KLController
from rlhf_ops.config.batch_plan import BatchPlan, PPOPlan
from rlhf_ops.config.schema import AlgorithmConfig, RunConfig
from rlhf_ops.data.dataset import PromptLoader
from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams, rollout_logprobs_comparable
from rlhf_ops.tracking.logger import MetricLogger
from rlhf_ops.trainer import determinism
from rlhf_ops.trainer.advantage import apply_reward_kl, build_kl_controller, compute_advantage
from rlhf_ops.trainer.async_pipeline import AsyncPipeline, RolloutGroup
from rlhf_ops.trainer.balance import balance_tokens_across_ranks
from rlhf_ops.trainer.dynamic_sampling import ScoredBatch, fill_dynamic_batch
from rlhf_ops.trainer.early_stop import EarlyStop
from rlhf_ops.trainer.faults import NothingLeftToTrain, Preempted, PreemptionNotice, SaveSchedule
from rlhf_ops.trainer.faults import warn_if_grace_too_short as _warn_if_grace_too_short
from rlhf_ops.trainer.generation import MEDIA_KEYS, gen_keys, merge_generation
from rlhf_ops.trainer.metrics import (
    compute_data_metrics,
    compute_reward_metrics_by_source,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    log_profile_traces,
)
from rlhf_ops.trainer.one_step_off import OneStepOffPipeline
from rlhf_ops.trainer.reward import RewardStage
from rlhf_ops.trainer.roles import ActorRolloutRef, Checkpointer, Critic, Tokenizer
from rlhf_ops.trainer.sample_ledger import SampleLedger
from rlhf_ops.trainer.state import TrainerState as TrainerState
from rlhf_ops.trainer.timing import StageTimer
from rlhf_ops.trainer.validation import validate

log = logging.getLogger(__name__)


def needs_old_log_prob(algorithm: AlgorithmConfig, plan: PPOPlan) -> bool:
    """Whether a step needs the actor's separate old-log-prob forward before the update.

    Not when the update is on-policy (one PPO epoch of one mini-batch: every forward runs before the only
    optimizer step, so the update uses its own detached log-probs, as verl and TRL do), unless the KL
    penalty in the reward needs them before the update.
    """
    return algorithm.use_kl_in_reward or not plan.on_policy


def _add_worker_timing(timer: StageTimer, out: DataProto) -> None:
    """``timing_s/worker/<name>``: seconds a worker spent computing (rank 0's), vs the stage's wall time."""
    for name, seconds in (out.meta_info.get("timing") or {}).items():
        timer.add(f"worker/{name}", float(seconds))


def with_keys(batch: DataProto, added: Mapping[str, torch.Tensor]) -> DataProto:
    """A new batch holding ``batch``'s keys and ``added`` (a key in both must hold equal values)."""
    if not added:
        return batch
    return batch.union(DataProto.from_dict(dict(added)))


class PPOTrainer:
    """Drives the worker groups through ``fit()``; holds no model, only the dataflow.

    Each stage returns the keys it computes and :meth:`step` unions them into the step's batch, so a stage
    never changes the batch it was given. ``plan`` must be derived with ``steps_per_epoch=len(train_loader)``:
    the run's length is ``plan.total_steps``.
    """

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
        preemption: PreemptionNotice | None = None,
        async_rollout: RolloutGroup | None = None,
        roles: Mapping[str, Any] | None = None,
    ) -> None:
        self.config, self.plan = config, plan
        self.roles = dict(
            roles or {}
        )  # every started worker role's client by name: a stage of a new role reads its own
        self.actor_rollout_ref, self.critic, self.reward = actor_rollout_ref, critic, reward
        self.train_loader, self.val_loader = train_loader, val_loader
        self.logger, self.tokenizer, self.checkpointer = logger, tokenizer, checkpointer
        self.preemption = preemption  # SIGTERM: checkpoint at the end of the step, then stop (rlhf_ops.trainer.faults)
        # Every id that ends a response (rlhf_ops.models.generation.eos_token_ids); default: the tokenizer's.
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids else [int(tokenizer.eos_token_id)]
        self.kl_ctrl: KLController = build_kl_controller(config.algorithm.kl_ctrl)
        self.early_stop = EarlyStop(config.trainer.early_stop)
        self.recorder: Any = None  # trainer.dump_rollouts / replay_rollouts: rollout_dump.Rollout{Recorder,Replay}
        self.replay: Any = None
        self.state = TrainerState()
        self.samples = SampleLedger()  # the sample ids each step consumed, through checkpoints (sample_ledger.py)
        if plan.total_steps is None or plan.steps_per_epoch != len(train_loader):
            raise ValueError(
                f"the plan was derived for {plan.steps_per_epoch} steps per epoch but the loader has "
                f"{len(train_loader)}: pass derive_batch_plan(config, steps_per_epoch=len(train_loader))"
            )
        self.total_steps = plan.total_steps
        self.needs_old_log_prob = needs_old_log_prob(config.algorithm, plan.actor)
        # trainer.pipeline=one_step_off: the next step's rollout runs while this one trains (one_step_off.py).
        self.pipeline: OneStepOffPipeline | AsyncPipeline | None = None
        if config.trainer.pipeline == "async":  # a rollout group of its own (async_pipeline.py)
            if async_rollout is None:
                raise ValueError("trainer.pipeline=async needs the rollout group: pass async_rollout")
            self.pipeline = AsyncPipeline(
                async_rollout,
                actor_rollout_ref,  # type: ignore[arg-type]  # the Ray client has full_state_dict
                train_loader,
                n=plan.rollout_n,
                sampling=self.sampling,
                total_steps=self.total_steps,
                config=config.trainer.async_rollout,
            )
        elif config.trainer.pipeline == "one_step_off":
            self.pipeline = OneStepOffPipeline(
                actor_rollout_ref,
                train_loader,
                n=plan.rollout_n,
                sampling=self.sampling,
                total_steps=self.total_steps,
            )

    # ---- stages: each returns what it adds ------------------------------------------------------
    def sampling(self, *, greedy: bool = False) -> SamplingParams:
        """The training rollout's sampling settings (one sample per row: the trainer repeats the prompts)."""
        r = self.config.rollout
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            do_sample=not greedy,
            response_length=r.max_new_tokens,
            eos_token_id=tuple(self.eos_token_ids),
            pad_token_id=int(self.tokenizer.pad_token_id),
        )

    def generate(self, prompts: DataProto, timer: StageTimer, *, step: int | None) -> DataProto:
        """The step's sequences: n samples per prompt (rows repeated interleaved, so group ids stay adjacent)
        with the prompts' columns, and ``reward_baselines`` (B,) for ReMax."""
        baseline = None
        if ADVANTAGE_ESTIMATORS.get(self.config.algorithm.adv_estimator).needs_greedy_baseline:
            with timer.stage("gen_max"):
                baseline = self._greedy_baseline(prompts, step=step)
        repeated = prompts.repeat(self.plan.rollout_n, interleave=True)
        with timer.stage("gen"):
            out = self.actor_rollout_ref.generate_sequences(repeated, self.sampling(), step=step)
        _add_worker_timing(timer, out)
        batch = merge_generation(repeated, out, keys=gen_keys(out))
        if baseline is not None:
            batch = with_keys(batch, {"reward_baselines": baseline.repeat_interleave(self.plan.rollout_n)})
        return batch

    def _greedy_baseline(self, prompts: DataProto, *, step: int | None) -> torch.Tensor:
        """ReMax's baseline (B,): the reward of each prompt's greedy response."""
        keys = ["input_ids", "attention_mask", "position_ids"]
        greedy = prompts.select(batch_keys=[*keys, *(k for k in MEDIA_KEYS if k in prompts.tensors.keys())])
        greedy.non_tensor_batch = dict(prompts.non_tensor_batch)
        generated = self.actor_rollout_ref.generate_sequences(greedy, self.sampling(greedy=True), step=step)
        out = merge_generation(greedy, generated, keys=gen_keys(generated))
        scores, _ = self.reward.score(out)
        return scores["token_level_scores"].sum(-1)

    def _score(self, batch: DataProto, timer: StageTimer) -> tuple[DataProto, dict[str, list[float]]]:
        with timer.stage("reward"):
            scores, extra = self.reward.score(batch)
        return with_keys(batch, scores), extra

    def old_log_prob(
        self, batch: DataProto, timer: StageTimer, metrics: dict[str, float], *, step: int | None
    ) -> dict[str, torch.Tensor]:
        """``old_log_probs`` (B, R) at the rollout temperature (``timing_s/old_log_prob``, verl's name)."""
        with timer.stage("old_log_prob"):
            old = self.actor_rollout_ref.compute_log_prob(
                batch, temperature=self.config.rollout.temperature, step=step
            )
        _add_worker_timing(timer, old)
        old_log_probs = old.tensors["old_log_probs"]
        # The engine's log-probs against the actor's recompute (skipped pass: the update reports it from
        # its first forward). Engines report log-probs at the rollout temperature unless top-p / top-k truncate
        # the sampled distribution (then at temperature 1): compare only when that is the actor's temperature.
        r = self.config.rollout
        comparable = rollout_logprobs_comparable(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        if "rollout_log_probs" in batch.tensors.keys() and comparable:
            b = batch.tensors
            metrics.update(compute_rollout_probs_diff(b["rollout_log_probs"], old_log_probs, b["response_mask"]))
        return {"old_log_probs": old_log_probs}

    def ref_log_prob(self, batch: DataProto, timer: StageTimer, *, step: int | None) -> dict[str, torch.Tensor]:
        """``ref_log_prob`` (B, R) under the reference policy, at the rollout temperature."""
        with timer.stage("ref"):
            ref = self.actor_rollout_ref.compute_ref_log_prob(
                batch, temperature=self.config.rollout.temperature, step=step
            )
        _add_worker_timing(timer, ref)
        return {"ref_log_prob": ref.tensors["ref_log_prob"]}

    def values(self, batch: DataProto, timer: StageTimer, *, step: int | None) -> dict[str, torch.Tensor]:
        """``values`` (B, R) of the critic."""
        assert self.critic is not None
        with timer.stage("values"):
            return {"values": self.critic.compute_values(batch, step=step).tensors["values"]}

    def advantages(self, batch: DataProto, timer: StageTimer, metrics: dict[str, float]) -> dict[str, torch.Tensor]:
        """``token_level_rewards`` (KL in the reward when configured), then ``advantages`` and ``returns``."""
        with timer.stage("adv"):
            rewards, kl_metrics = apply_reward_kl(batch, self.config.algorithm, self.kl_ctrl)
            metrics.update(kl_metrics)
            return {**rewards, **compute_advantage(with_keys(batch, rewards), self.config.algorithm)}

    def step(self, batch: DataProto, *, step: int | None = None) -> dict[str, float]:
        """One training step on a batch of prompts; returns its metrics.

        ``step`` (the global step, 1-based) seeds the rollout sampling and the actor's mini-batch shuffle;
        None (a step run outside :meth:`fit`): the engines' running generators and the actor's update count.
        """
        timer, metrics = StageTimer(), dict[str, float]()
        start = time.perf_counter()
        batch = self.generate(batch, timer, step=step) if self.replay is None else batch
        return self.train_step(batch, timer, metrics, start=start, step=step)

    def pipelined_step(self, step: int) -> tuple[dict[str, float], int]:
        """One step under ``trainer.pipeline=one_step_off``: its batch was generated while the previous step
        trained, and the next one's is generated while this one trains. Returns the metrics and the batch's epoch.
        """
        assert self.pipeline is not None
        timer, metrics = StageTimer(), dict[str, float]()
        start = time.perf_counter()
        batch, epoch, lag = self.pipeline.next_batch(step, timer)
        metrics["training/policy_lag"] = float(lag)  # actor updates between the rollout's weights and this update
        metrics = self.train_step(batch, timer, metrics, start=start, step=step)
        if isinstance(self.pipeline, AsyncPipeline):  # weights to the rollout group; lag, buffer, idle metrics
            metrics.update(self.pipeline.after_update(step, timer))
            metrics.update({k: v for k, v in timer.metrics().items() if "weight_push" in k})
        return metrics, epoch

    @property
    def _keep_groups(self) -> bool:
        """Balance whole prompt groups across ranks: shared-prompt forwards want a group in one micro-batch."""
        return self.config.actor.share_prompt_prefix or (
            self.critic is not None and self.config.critic.share_prompt_prefix
        )

    def _scored_batch(
        self, batch: DataProto, timer: StageTimer, metrics: dict[str, float], *, step: int | None
    ) -> DataProto:
        """The generated ``batch`` balanced across ranks, scored (``train/*`` reward metrics) and filtered."""
        if self.config.trainer.balance_batch:
            batch, imbalance = balance_tokens_across_ranks(
                batch, dp_size=self.plan.actor.mesh.dp_size, keep_groups=self._keep_groups
            )
            metrics["perf/dp_token_imbalance"] = imbalance
        batch, extra = self._score(batch, timer)
        scores = batch.tensors["token_level_scores"].sum(-1)
        metrics.update(
            compute_reward_metrics_by_source(
                scores, list(batch.non_tensor_batch["data_source"]), prefix="train", extra=extra
            )
        )
        if self.config.algorithm.filter_groups.enable:  # DAPO: refill zero-variance groups from the next prompts
            batch = self._dynamic_sampling(ScoredBatch(batch, extra), timer, metrics, step=step)
        if self.recorder is not None and step is not None:  # trainer.dump_rollouts (rollout_dump.py)
            self.recorder.dump(step, batch, extra=extra, metrics=metrics)
        return batch

    def train_step(
        self, batch: DataProto, timer: StageTimer, metrics: dict[str, float], *, start: float, step: int | None
    ) -> dict[str, float]:
        """Every stage after generation, on the generated ``batch``; ``start`` is the step's start (throughput)."""
        if self.replay is None:
            batch = self._scored_batch(batch, timer, metrics, step=step)
        else:  # trainer.replay_rollouts: the dumped step, balanced, scored and filtered as it was
            batch = self.replay.batch(step or self.state.global_step + 1, metrics)
        metrics.update(self.samples.record(batch.non_tensor_batch["uid"]))
        if self.needs_old_log_prob:
            batch = with_keys(batch, self.old_log_prob(batch, timer, metrics, step=step))
        if self.config.needs_ref:
            batch = with_keys(batch, self.ref_log_prob(batch, timer, step=step))
        if self.critic is not None:
            batch = with_keys(batch, self.values(batch, timer, step=step))
        batch = with_keys(batch, self.advantages(batch, timer, metrics))
        if self.critic is not None:
            with timer.stage("update_critic"):
                metrics.update(self.critic.update_critic(batch, step=step))
        with timer.stage("update_actor"):
            metrics.update(
                self.actor_rollout_ref.update_actor(batch, temperature=self.config.rollout.temperature, step=step)
            )
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

    def _dynamic_sampling(
        self, first: ScoredBatch, timer: StageTimer, metrics: dict[str, float], *, step: int | None
    ) -> DataProto:
        """The step's batch of informative groups (rlhf_ops.trainer.dynamic_sampling); ``train/<source>/*``
        reward metrics stay those of the step's own prompts (an unbiased sample of the policy)."""

        def next_round() -> ScoredBatch:
            batch, extra = self._score(self.generate(self.train_loader.next_batch(), timer, step=step), timer)
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
                batch, dp_size=self.plan.actor.mesh.dp_size, keep_groups=self._keep_groups
            )
        return batch

    # ---- loop ---------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        if self.val_loader is None or self.replay is not None:  # a replay runs no rollout engine
            return {}
        if self.pipeline is not None:  # validation syncs the newest weights: the prefetch must be done with its own
            self.pipeline.drain()
        return validate(
            self.actor_rollout_ref,
            self.val_loader,
            reward=self.reward,
            sampling=self.config.rollout.val_kwargs,
            response_length=self.config.rollout.max_new_tokens,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            step=determinism.validation_step(self.state.global_step),
        )

    def fit(self) -> TrainerState:
        """Runs from the current state (0, or a resumed step) to ``total_steps``.

        Raises:
            NothingLeftToTrain: the resumed checkpoint already completed every step.
            Preempted: a preemption notice stopped the run (after a checkpoint of its last step).
        """
        cfg = self.config.trainer
        schedule = SaveSchedule(save_freq=cfg.save_freq, save_every_s=cfg.save_every_s)
        if self.checkpointer is not None:
            resumed = self.checkpointer.maybe_resume(self)
            schedule.saved_step = resumed
            if resumed is not None and resumed >= self.total_steps:
                raise NothingLeftToTrain(
                    f"nothing left to train: the checkpoint at step {resumed} already completed all "
                    f"{self.total_steps} steps of this run; raise trainer.total_epochs or "
                    "trainer.total_training_steps to train on, or set trainer.resume_mode=disable to start over"
                )
        if cfg.val_before_train and self.state.global_step == 0:
            self.logger.log_metrics(self.validate(), step=0)
        bar = tqdm(total=self.total_steps, initial=self.state.global_step, desc="rlhf", dynamic_ncols=True)
        warned = False
        while self.state.global_step < self.total_steps and self.early_stop.reason is None:
            self._stop_if_preempted(schedule)
            step = self.state.global_step + 1
            started = time.monotonic()
            # Rollout sampling and the actor's mini-batch shuffle are seeded from the step, not from how
            # many calls a worker has seen: a resumed run redoes exactly the uninterrupted run's steps
            # (the loader's position, the KL controller and the driver's torch RNG come from state_dict).
            if self.pipeline is None:
                metrics = self.step(self.train_loader.next_batch(), step=step)
                epoch = self.train_loader.epoch
            else:
                metrics, epoch = self.pipelined_step(step)
            metrics["training/global_step"] = float(step)
            metrics["training/epoch"] = float(epoch)
            self.state.global_step = step
            if cfg.test_freq and (step % cfg.test_freq == 0 or step == self.total_steps):
                metrics.update(self.validate())
            self.early_stop.update(metrics, step, step_s=time.monotonic() - started)  # may make this the last step
            self.state.history.append({k: metrics[k] for k in _HISTORY_KEYS if k in metrics})
            self.logger.log_metrics(metrics, step=step)
            if step in cfg.profile_steps:  # the workers traced this step: attach their files to the run
                log_profile_traces(self.logger, os.path.abspath(cfg.profile_dir), step=step)
            bar.set_postfix(reward=f"{metrics.get('critic/score/mean', float('nan')):.3f}")
            bar.update(1)
            step_s = time.monotonic() - started
            is_last = step == self.total_steps or self.early_stop.reason is not None
            reason = schedule.due(step, is_last=is_last) if self.checkpointer is not None else None
            if reason is not None:
                self._save(schedule, step, reason=reason)
                if not warned and schedule.last_save_s is not None:
                    grace = cfg.preemption_grace_s
                    warned = _warn_if_grace_too_short(grace, save_s=schedule.last_save_s, step_s=step_s)
        bar.close()
        if self.checkpointer is not None:
            self.checkpointer.finish()
        return self.state

    def _save(self, schedule: SaveSchedule, step: int, *, reason: str) -> None:
        assert self.checkpointer is not None
        if reason == "save_every_s":
            log.info("time-based checkpoint of step %d (trainer.save_every_s=%g)", step, schedule.save_every_s)
        started = time.monotonic()
        self.checkpointer.save(self)
        schedule.saved(step, started=started)
        if self.preemption is not None:
            self.preemption.committed_step = step

    def _stop_if_preempted(self, schedule: SaveSchedule) -> None:
        """At a safe point (between steps): after a preemption notice, checkpoint the last step (unless it is
        saved already), wait for its upload, and raise :class:`Preempted`."""
        if self.preemption is None or not self.preemption.check():  # check(): notices other processes received
            return
        step = self.state.global_step
        if self.checkpointer is not None:
            if step > 0 and schedule.saved_step != step:
                self._save(schedule, step, reason="preemption")
            self.checkpointer.finish()  # the node may be gone soon: the remote copy must be complete first
        self.preemption.stopping = True
        committed = schedule.saved_step
        raise Preempted(
            f"preempted at step {step} of {self.total_steps}: checkpoint of step {committed} committed "
            f"{self.preemption.elapsed_s():.1f} s after the notice ({self.preemption.source}; grace "
            f"{self.preemption.grace_s:g} s); "
            "resubmit the same command to resume",
            committed_step=committed,
        )

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        pipeline = self.pipeline.state_dict() if self.pipeline is not None else None  # waits for the prefetch
        # one_step_off: the loader position before the prefetched prompts (they are saved as a generated batch).
        self.state.loader = self.train_loader.state_dict() if self.pipeline is None else self.pipeline.loader_state()
        self.state.kl_ctrl = dict(self.kl_ctrl.state_dict())
        self.state.rng = {"torch": torch.random.get_rng_state().tolist()}
        state = {
            "global_step": self.state.global_step,
            "loader": self.state.loader,
            "kl_ctrl": self.state.kl_ctrl,
            "rng": self.state.rng,
            "history": self.state.history,
            "samples": self.samples.state_dict(),
            "early_stop": self.early_stop.state_dict(),
        }
        if self.pipeline is not None:
            state["pipeline"] = pipeline
        return state

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
        self.samples.load_state_dict(state.get("samples"))
        self.early_stop.load_state_dict(state.get("early_stop"))
        if "torch" in self.state.rng:
            torch.random.set_rng_state(torch.tensor(self.state.rng["torch"], dtype=torch.uint8))
        if self.pipeline is not None:  # a sync run's "pipeline" is absent: its next step generates synchronously
            self.pipeline.load_state_dict(state.get("pipeline"))


_HISTORY_KEYS = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"]
