"""``DataParallelPPOActor``: log-probs and the PPO policy update of an FSDP2 policy (verl's ``dp_actor.py``).

Notation: B = sequences on this rank, T = P + R full length, R = response length.

Loss scaling (why gradients do not depend on how a mini-batch is split):
every micro-batch loss is its *contribution* to the mini-batch loss: token / sequence sums divided by the
GLOBAL token / sequence counts of the mini-batch (all-reduced over the dp group), so the sum over all
micro-batches of all ranks is exactly the loss of the whole mini-batch. Gradient accumulation sums the
micro-batch gradients on each rank; FSDP2's reduce-scatter then AVERAGES over the dp ranks (it divides by
the mesh size). Each micro-batch loss is therefore multiplied by ``dp_size`` before ``backward``, turning
that average into the sum. The result: the same gradient for 1 rank x micro 4, 1 rank x 4 micro of 1,
or 2 ranks x 2, up to float rounding.

Ulysses sequence parallelism (``sp_group`` of sp > 1 ranks sharing the same samples): each rank forwards
1/sp of every packed micro-batch and the log-probs are gathered, so every rank of the group computes the same
loss, while its parameter gradient is only the share of the computations it ran (the sum over the group is
the gradient; see ``workers.sp.ulysses``). FSDP averages over all dp x sp ranks, so the loss is multiplied by
dp x sp. Token / sequence counts and metrics are reduced over the dp group only (SP ranks hold duplicates).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_ops.algorithms import PolicyLossFn, agg_loss, kl_penalty, truncated_is_weights
from rlhf_ops.algorithms.rollout_correction import rollout_is_weights
from rlhf_ops.config.batch_plan import ForwardPlan, PPOPlan
from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig
from rlhf_ops.extensions import POLICY_LOSSES as POLICY_LOSS_TABLE
from rlhf_ops.protocol import DataProto
from rlhf_ops.trainer.metrics import ROLLOUT_DIFF_MAX, ROLLOUT_DIFF_MEAN, rollout_probs_diff_stats
from workers.actor.forward import response_log_probs, supports_logits_to_keep
from workers.fsdp.update_loop import MiniBatchUpdate
from workers.sp.ulysses import ulysses_sequence_parallel
from workers.utils.dist import MetricAccumulator, all_reduce
from workers.utils.forward_runner import check_parallel_groups, forward_micro_batches
from workers.utils.micro_batch import split_mini_batches
from workers.utils.prompt_group_attention import enable_per_prompt_attention
from workers.utils.shared_prompt import forwarded_lengths

__all__ = ["DataParallelPPOActor", "bind_policy_loss"]

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
_UPDATE_KEYS = (*_FORWARD_KEYS, "response_mask", "advantages")


def bind_policy_loss(algorithm: AlgorithmConfig, *, seed: int = 0) -> PolicyLossFn:
    """The ``algorithm.policy_loss`` entry of the table, its own hyper-parameters bound from ``algorithm.*``.

    The entry's ``config_params`` name the fields bound by keyword (Clip-Cov's ``clip_cov_ratio``...); a
    ``seeded`` entry gets one generator for the actor's life, so its random token choice is reproducible.
    """
    entry = POLICY_LOSS_TABLE.get(algorithm.policy_loss)
    loss: Any = entry.load()
    bound: dict[str, Any] = {name: getattr(algorithm, name) for name in entry.config_params}
    if entry.seeded:
        bound["generator"] = torch.Generator().manual_seed(seed)
    return functools.partial(loss, **bound) if bound else loss


_MEDIA_KEYS = ("pixel_values",)  # vision-language policies: (B, k, C, H, W), split by rows like the rest


def _with_media(data: DataProto, keys: tuple[str, ...]) -> tuple[str, ...]:
    """``keys`` plus the media keys ``data`` holds."""
    present = set(data.batch.keys()) if data.batch is not None else set()
    return (*keys, *(k for k in _MEDIA_KEYS if k in present))


def _require(data: DataProto, keys: tuple[str, ...], what: str) -> None:
    present = set(data.batch.keys()) if data.batch is not None else set()
    missing = [k for k in keys if k not in present]
    if missing:
        raise ValueError(f"{what} needs batch keys {missing}; present: {sorted(present)}.")


class DataParallelPPOActor:
    """The math-facing loops of the actor (and of the reference policy, without optimizer).

    Args:
        module: The policy, FSDP2-wrapped (``apply_fsdp2``) or plain for a single rank.
        optimizer: Needed by :meth:`update_policy` only (None for the reference policy).
        lr_scheduler: Stepped after every optimizer step.
        config: The actor section (grad clip, remove padding, shuffle).
        algorithm: Policy loss, clip ratios, entropy / KL-loss coefficients, ``loss_agg_mode``, epochs.
        plan: Per-rank sizes derived by the driver (never recomputed here).
        dp_group: Group of all data-parallel ranks (default: the default group). Its size must equal
            ``plan.mesh.dp_size``. With sequence parallelism: the ranks holding the same SP position.
        sp_group: Ulysses group of this rank (None: no sequence parallelism); its size must equal
            ``plan.mesh.sp_size``. With more than one rank it needs ``config.use_remove_padding`` and switches
            the module's attention to ``ulysses_<base>`` (``workers.sp.enable_ulysses_attention``).
        device: Where micro-batches are computed; default: the device of the first parameter (pass
            ``cuda`` explicitly with ``param_offload``, whose shards live on the host).
        seed: Seeds the mini-batch shuffle (with the step number, so every update shuffles differently).

    Raises:
        ValueError: The dp / sp group's size differs from the plan's, or sp > 1 without remove padding.
    """

    role = "actor"

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        lr_scheduler: LRScheduler | None = None,
        *,
        config: ActorConfig,
        algorithm: AlgorithmConfig,
        plan: PPOPlan,
        dp_group: dist.ProcessGroup | None = None,
        sp_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        rollout_logprobs_at_temperature: bool = False,
    ) -> None:
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        # True when the rollout engine reports log-probs at the sampling temperature (its "processed" mode):
        # then the on-policy update compares them with its own at any temperature, not only at 1.
        self.rollout_logprobs_at_temperature = rollout_logprobs_at_temperature
        self.config, self.algorithm, self.plan = config, algorithm, plan
        self.dp_group, self.sp_group, self.seed = dp_group, sp_group, seed
        self.dp_size, self.sp_size = check_parallel_groups(
            "actor",
            module,
            mesh=plan.mesh,
            dp_group=dp_group,
            sp_group=sp_group,
            use_remove_padding=config.use_remove_padding,
        )
        # Each micro-batch loss is already divided by the mini-batch's GLOBAL token / sequence count, so the
        # gradient wanted is the plain sum over ranks; FSDP's reduce-scatter averages over the dp x sp ranks
        # that hold the shards (SP ranks too: each one backwards its slice of the same rows), so undo that mean.
        self.loss_scale = self.dp_size * self.sp_size
        """FSDP averages gradients over dp x sp ranks; each micro-batch loss is multiplied by this before backward."""
        if config.share_prompt_prefix and config.share_prompt_attention == "per_prompt":
            enable_per_prompt_attention(module)  # the shared-prompt row attended per prompt group
        self.device = torch.device(device) if device is not None else next(module.parameters()).device
        self._keep_logits = supports_logits_to_keep(module)
        self._policy_loss = bind_policy_loss(algorithm, seed=seed)
        self._num_updates = 0
        self.last_update_tokens = 0
        """Valid tokens (attention mask) forwarded and backwarded by the last :meth:`update_policy` on this rank."""
        self.on_policy = plan.on_policy
        """One epoch of one mini-batch: every forward of the update runs before its only optimizer step, so the
        update's own log-probs (detached) are the old log-probs and no separate old-log-prob pass is needed."""
        self._diff_max: Tensor | None = None
        self.last_update_seq_lens: list[int] = []
        """Valid length of every sequence the last update trained on (once per epoch), for the FLOP count."""

    # ------------------------------------------------------------------------------------------- forward
    def _forward(
        self, micro: DataProto, *, temperature: float, calculate_entropy: bool, entropy_requires_grad: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        batch = micro.batch
        assert batch is not None
        pixel_values = batch["pixel_values"].to(self.device) if "pixel_values" in batch.keys() else None
        return response_log_probs(
            self.module,
            input_ids=batch["input_ids"].to(self.device),
            attention_mask=batch["attention_mask"].to(self.device),
            position_ids=batch["position_ids"].to(self.device),
            response_length=batch["responses"].shape[-1],
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            entropy_requires_grad=entropy_requires_grad,
            use_remove_padding=self.config.use_remove_padding,
            keep_logits=self._keep_logits,
            sp_group=self.sp_group,
            pixel_values=pixel_values,
            share_prompts=self.config.share_prompt_prefix,
        )

    def compute_log_prob(
        self,
        data: DataProto,
        *,
        calculate_entropy: bool = False,
        temperature: float = 1.0,
        forward: ForwardPlan | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (B, R) of ``responses`` under the current weights, and entropy (B, R) when asked.

        Micro-batches of ``forward`` (default ``plan.log_prob``: ``log_prob_micro_batch_size_per_rank`` rows,
        or at most ``log_prob_max_token_len_per_rank`` tokens with dynamic batch size; the reference policy
        passes ``BatchPlan.ref``). No gradient. Results are fp32, in the input order, on the input's device.
        A collective under FSDP: every rank of the group must call it with the same number of micro-batches
        (guaranteed with dynamic batch size; with fixed ones, dispatch equal row counts).

        Args:
            data: Holds ``input_ids``, ``attention_mask``, ``position_ids`` (B, T) and ``responses`` (B, R).
            calculate_entropy: Also return the token entropy.
            temperature: Logits are divided by it (the rollout temperature).
            forward: The micro-batching (None: ``plan.log_prob``).
        """
        _require(data, _FORWARD_KEYS, "compute_log_prob")
        log_probs, entropy = forward_micro_batches(
            data.select(list(_with_media(data, _FORWARD_KEYS))),
            forward if forward is not None else self.plan.log_prob,
            lambda micro: self._forward(micro, temperature=temperature, calculate_entropy=calculate_entropy),
            dp_group=self.dp_group,
            sp_group=self.sp_group,
            out_device=data.tensors["input_ids"].device,
        )
        assert log_probs is not None
        return log_probs, entropy

    # ------------------------------------------------------------------------------------------- update
    def update_policy(self, data: DataProto, *, temperature: float = 1.0, step: int | None = None) -> dict[str, float]:
        """PPO epochs x mini-batches (one optimizer step each) x micro-batches (gradient accumulation).

        Args:
            data: This rank's share: ``input_ids``, ``attention_mask``, ``position_ids`` (B, T), ``responses``,
                ``response_mask``, ``old_log_probs``, ``advantages`` (B, R), and ``ref_log_prob`` (B, R) when
                ``algorithm.use_kl_loss``. ``old_log_probs`` may be absent when :attr:`on_policy`: then the
                update's own detached log-probs stand in for them (verl, TRL), and with ``rollout_log_probs``
                present the returned metrics add ``training/rollout_probs_diff_{max,mean}`` of those
                pre-step log-probs.
            temperature: The temperature the old log-probs were computed with.
            step: Seeds the mini-batch shuffle with the global step, so a resumed run shuffles as the
                uninterrupted one (None: the count of updates).

        Returns:
            Global metrics (identical on every rank; loss values are mini-batch losses averaged over the
            optimizer steps, ratios are token-weighted means): ``actor/pg_loss``, ``actor/pg_clipfrac``,
            ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy``, ``actor/kl_loss`` and
            ``actor/kl_coef`` (with the KL loss), ``actor/grad_norm`` (mean over steps), ``actor/lr`` (of the
            last step), ``actor/skipped_step_frac`` (share of steps skipped for a non-finite grad norm). With
            ``algorithm.ppo_target_kl``: ``actor/kl_early_stop`` (1 when the stop fired in this update, so its
            mean over steps is how often it fires) and ``actor/trained_mini_batch_frac`` (optimizer steps taken /
            planned), ``actor/ppo_kl_k3`` (the non-negative KL estimate it compares). With
            ``algorithm.tis_imp_ratio_cap``: ``actor/tis_weight_mean``, ``actor/tis_clipfrac``. With
            ``algorithm.rollout_correction.rollout_is``: ``rollout_corr/*`` (rlhf_ops.algorithms.rollout_correction).
            Loss metrics include the mini-batch on which the early stop fired (its step was skipped).

        Raises:
            ValueError: No optimizer, a missing key, or a batch that does not split into mini-batches.
        """
        if self.optimizer is None:
            raise ValueError("update_policy needs an optimizer; build the actor with build_optimizer(...).")
        keys = (*_UPDATE_KEYS, "ref_log_prob") if self.algorithm.use_kl_loss else _UPDATE_KEYS
        present = set(data.batch.keys()) if data.batch is not None else set()
        if "old_log_probs" in present or not self.on_policy:
            keys = (*keys, "old_log_probs")
        elif "rollout_log_probs" in present and (temperature == 1.0 or self.rollout_logprobs_at_temperature):
            # On-policy: the first forward's log-probs give the rollout diff, when the engine's log-probs are
            # of the distribution this forward computes (temperature 1, or the engine's "processed" mode).
            keys = (*keys, "rollout_log_probs")
            self._diff_max = torch.zeros((), device=self.device)
        algo = self.algorithm
        correction = algo.tis_imp_ratio_cap is not None or algo.rollout_correction.rollout_is is not None
        if correction and "rollout_log_probs" not in keys:
            keys = (*keys, "rollout_log_probs")
        _require(data, keys, "update_policy")
        data = data.select(list(_with_media(data, keys)))
        step_seed = step if step is not None else self._num_updates
        self.module.train()
        acc = MetricAccumulator(self.device)
        tokens, trained, planned, stopped = 0, 0, 0, False
        self.last_update_seq_lens = []
        # Open across backward too: activation checkpointing recomputes the Ulysses attention there.
        with ulysses_sequence_parallel(self.sp_group):
            for epoch in range(self.plan.ppo_epochs):
                # Seeded by (seed, global step, epoch), never by how many updates this process has run: a run
                # resumed from a checkpoint at step k shuffles step k + 1 exactly as the uninterrupted run did.
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step_seed * 1_009 + epoch)
                minis = split_mini_batches(
                    data,
                    mini_batch_size=self.plan.mini_batch_size_per_rank,
                    shuffle=self.config.shuffle,
                    generator=generator,
                )
                planned = len(minis) * self.plan.ppo_epochs
                for mini in minis:
                    step_tokens, stopped = self._update_mini_batch(mini, acc, temperature=temperature)
                    self.last_update_seq_lens += self._forwarded_lengths(mini)
                    tokens += step_tokens
                    if stopped:
                        break
                    trained += 1
                if stopped:
                    break
        if self.algorithm.ppo_target_kl is not None:
            acc.add_step("actor/kl_early_stop", float(stopped))  # 1 on the steps it fired: its mean is the rate
            acc.add_step("actor/trained_mini_batch_frac", trained / max(planned, 1))
        self._num_updates += 1
        self.last_update_tokens = tokens // self.sp_size  # each SP rank forwards 1/sp of the tokens
        metrics = acc.reduce(group=self.dp_group)
        if self._diff_max is not None:
            metrics[ROLLOUT_DIFF_MAX] = all_reduce(self._diff_max, op=dist.ReduceOp.MAX, group=self.dp_group).item()
            self._diff_max = None
        return metrics

    def _forwarded_lengths(self, mini: DataProto) -> list[int]:
        """Token lengths the update's forwards ran on (shared prompts count once), for the FLOP count."""
        batch = mini.batch
        assert batch is not None
        if self.config.share_prompt_prefix:
            return forwarded_lengths(
                batch["input_ids"], batch["attention_mask"], response_length=batch["responses"].shape[-1]
            )
        return batch["attention_mask"].sum(-1).tolist()

    def _kl_early_stop(self, kl_sum: Tensor, kl_tokens: Tensor) -> bool:
        """True on every rank when the mini-batch's global k3 KL exceeds ``kl_early_stop_factor x ppo_target_kl``.

        The token-weighted KL is all-reduced over the dp group, so each rank compares the same number against
        the same threshold and all of them stop together (a rank that stopped alone would hang the next
        collective of the others).
        """
        target = self.algorithm.ppo_target_kl
        if target is None:
            return False
        total = all_reduce(
            torch.stack([kl_sum, kl_tokens]).to(torch.float64), op=dist.ReduceOp.SUM, group=self.dp_group
        )
        kl = float(total[0] / total[1].clamp(min=1.0))
        return kl > self.algorithm.kl_early_stop_factor * target

    def _update_mini_batch(self, mini: DataProto, acc: MetricAccumulator, *, temperature: float) -> tuple[int, bool]:
        """Accumulates the gradient of one mini-batch and steps, unless the KL early stop fires (then the
        gradient is dropped); returns the valid tokens it forwarded and whether it stopped."""
        assert mini.batch is not None and self.optimizer is not None
        update = MiniBatchUpdate(
            "actor",
            self.module,
            self.optimizer,
            self.lr_scheduler,
            plan=self.plan,
            grad_clip=self.config.grad_clip,
            loss_scale=self.loss_scale,
            dp_group=self.dp_group,
            grad_sync_last_micro_batch=self.config.fsdp.grad_sync_last_micro_batch,
        )
        kl = [torch.zeros((), device=self.device, dtype=torch.float64) for _ in range(2)]  # summed k3, tokens

        def micro_loss(micro: DataProto, num_tokens: float, num_seqs: float) -> Tensor:
            loss, micro_kl_sum, micro_tokens = self._micro_batch_loss(
                micro, acc, num_tokens=num_tokens, num_seqs=num_seqs, temperature=temperature
            )
            kl[0], kl[1] = kl[0] + micro_kl_sum, kl[1] + micro_tokens
            return loss

        update.accumulate(mini, micro_loss)
        stopped = self._kl_early_stop(kl[0], kl[1])
        if stopped:  # Spinning Up's rule: no step on a mini-batch whose policy already moved too far from the old one
            update.drop(acc)
        else:
            update.step(acc)
        return int(mini.batch["attention_mask"].sum()), stopped

    def _micro_batch_loss(
        self, micro: DataProto, acc: MetricAccumulator, *, num_tokens: float, num_seqs: float, temperature: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """This micro-batch's contribution to the mini-batch loss (policy - entropy bonus + KL loss), its local
        summed k3 KL to the old policy (0 without the KL early stop) and its valid token count."""
        batch = micro.batch
        assert batch is not None
        algo = self.algorithm
        mask = batch["response_mask"].to(self.device)
        counts = {"global_num_tokens": num_tokens, "global_num_seqs": num_seqs, "norm_len": float(mask.shape[-1])}
        use_entropy = algo.entropy_coeff != 0.0
        log_prob, entropy = self._forward(
            micro, temperature=temperature, calculate_entropy=True, entropy_requires_grad=use_entropy
        )
        assert entropy is not None
        if "old_log_probs" in batch.keys():
            old_log_prob = batch["old_log_probs"].to(self.device)
        else:  # on-policy (see self.on_policy): ratio 1 in value, gradient adv * d log_prob, as verl and TRL
            old_log_prob = log_prob.detach()
            if self._diff_max is not None:
                top, total, count = rollout_probs_diff_stats(
                    batch["rollout_log_probs"].to(self.device), log_prob, mask
                )
                self._diff_max = torch.maximum(self._diff_max, top)
                acc.add_mean(ROLLOUT_DIFF_MEAN, total / count.clamp(min=1), count)
        is_weights = None
        if algo.tis_imp_ratio_cap is not None:
            rollout_log_probs = batch["rollout_log_probs"].to(self.device)
            is_weights, tis_metrics = truncated_is_weights(
                old_log_prob, rollout_log_probs, mask, cap=algo.tis_imp_ratio_cap
            )
            for name, value in tis_metrics.items():
                acc.add_mean(name, value, mask.sum())
        elif algo.rollout_correction.rollout_is is not None:  # verl's name; pre-flight refuses both at once
            is_weights, is_metrics = rollout_is_weights(
                old_log_prob,
                batch["rollout_log_probs"].to(self.device),
                mask,
                level=algo.rollout_correction.rollout_is,
                threshold=algo.rollout_correction.rollout_is_threshold,
            )
            for name, value in is_metrics.items():
                acc.add_mean(name, value, mask.sum())
        pg_loss, pg_metrics = self._policy_loss(
            old_log_prob,
            log_prob,
            batch["advantages"].to(self.device),
            mask,
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            clip_ratio_c=algo.clip_ratio_c,
            loss_agg_mode=algo.loss_agg_mode,
            is_weights=is_weights,
            **counts,
        )
        loss = pg_loss
        if use_entropy:
            loss = loss - algo.entropy_coeff * agg_loss(entropy, mask, algo.loss_agg_mode, **counts)
        if algo.use_kl_loss:
            kld = kl_penalty(log_prob, batch["ref_log_prob"].to(self.device), algo.kl_loss_type)
            kl_loss = agg_loss(kld, mask, algo.loss_agg_mode, **counts)
            loss = loss + algo.kl_loss_coef * kl_loss
            acc.add_sum("actor/kl_loss", kl_loss.detach())
            acc.add_step("actor/kl_coef", algo.kl_loss_coef)
        weight = mask.sum()
        acc.add_sum("actor/pg_loss", pg_loss.detach())
        for name, value in pg_metrics.items():
            acc.add_mean(name, value, weight)
        acc.add_mean("actor/entropy", (entropy.detach() * mask).sum() / weight.clamp(min=1), weight)
        kl_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        if algo.ppo_target_kl is not None:
            # k3 = r - 1 - log r with r = pi / pi_old (samples from pi_old): a non-negative KL(pi_old || pi)
            # estimate, so a mini-batch cannot hide a large move behind tokens whose k1 is negative.
            stop_kl = kl_penalty(old_log_prob, log_prob.detach(), "low_var_kl")
            kl_sum = (stop_kl * mask).sum().to(torch.float64)
            acc.add_mean("actor/ppo_kl_k3", kl_sum / weight.clamp(min=1), weight)
        return loss, kl_sum, weight.to(torch.float64)
