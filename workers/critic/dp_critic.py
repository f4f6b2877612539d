"""``DataParallelPPOCritic``: values and the clipped value-loss update of an FSDP2 critic (verl's ``dp_critic.py``).

Notation: B = sequences on this rank, T = P + R full length, R = response length.

The critic is a token-classification model with one label (``load_hf_model(kind="value")``): logits
(B, T, 1) are the value of each prefix. As in verl, the value of response token j is read at the column
that predicts it, ``[-R - 1 : -1]``, and masked by ``response_mask``. Loss scaling is the actor's (see
``workers.actor.dp_actor``): global counts per mini-batch, loss x dp_size x sp_size before backward.
With Ulysses sequence parallelism (``sp_group``) each rank forwards its slice of the packed row and the
values are gathered over the group (``workers.sp.ulysses``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_ops.algorithms import compute_value_loss
from rlhf_ops.config.batch_plan import ForwardPlan, PPOPlan
from rlhf_ops.config.schema import AlgorithmConfig, CriticConfig
from rlhf_ops.protocol import DataProto
from workers.fsdp.update_loop import MiniBatchUpdate
from workers.sp.ulysses import ulysses_sequence_parallel
from workers.utils.dist import MetricAccumulator
from workers.utils.forward_runner import check_parallel_groups, forward_micro_batches, forward_packed
from workers.utils.micro_batch import split_mini_batches
from workers.utils.prompt_group_attention import enable_per_prompt_attention
from workers.utils.remove_padding import pack_sequences, scatter_response
from workers.utils.shared_prompt import pack_shared_prompts, shared_prompt_mask_dtype
from workers.utils.trim_padding import trim_padding_columns

__all__ = ["DataParallelPPOCritic"]

_FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
_UPDATE_KEYS = (*_FORWARD_KEYS, "response_mask", "values", "returns")


def _require(data: DataProto, keys: tuple[str, ...], what: str) -> None:
    present = set(data.batch.keys()) if data.batch is not None else set()
    missing = [k for k in keys if k not in present]
    if missing:
        raise ValueError(f"{what} needs batch keys {missing}; present: {sorted(present)}.")


class DataParallelPPOCritic:
    """The math-facing loops of the critic.

    Args:
        module: Value model (FSDP2-wrapped or plain), logits (B, T, 1).
        optimizer: Needed by :meth:`update_critic`.
        lr_scheduler: Stepped after every optimizer step.
        config: The critic section (grad clip, ``cliprange_value``, remove padding).
        algorithm: ``loss_agg_mode`` and ``ppo_epochs``.
        plan: Per-rank sizes of the critic (``BatchPlan.critic``).
        dp_group: Group of all data-parallel ranks; its size must equal ``plan.mesh.dp_size``.
        sp_group: Ulysses group (None: none); its size must equal ``plan.mesh.sp_size``; > 1 needs
            ``config.use_remove_padding`` and switches the module to ``ulysses_<base>`` attention.
        device: Compute device; default: the first parameter's.
        seed: Unused shuffling seed slot kept for symmetry with the actor (the critic does not shuffle).
    """

    role = "critic"

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        lr_scheduler: LRScheduler | None = None,
        *,
        config: CriticConfig,
        algorithm: AlgorithmConfig,
        plan: PPOPlan,
        dp_group: dist.ProcessGroup | None = None,
        sp_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> None:
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self.config, self.algorithm, self.plan = config, algorithm, plan
        self.dp_group, self.sp_group, self.seed = dp_group, sp_group, seed
        self.dp_size, self.sp_size = check_parallel_groups(
            "critic",
            module,
            mesh=plan.mesh,
            dp_group=dp_group,
            sp_group=sp_group,
            use_remove_padding=config.use_remove_padding,
        )
        # Losses are normalised by global counts, so the wanted gradient is the sum over ranks; FSDP averages
        # over the dp x sp ranks holding the shards: multiplying by their number undoes that mean (as the actor).
        self.loss_scale = self.dp_size * self.sp_size
        if config.share_prompt_prefix and config.share_prompt_attention == "per_prompt":
            enable_per_prompt_attention(module, role="critic")  # the shared-prompt row attended per prompt group
        self.device = torch.device(device) if device is not None else next(module.parameters()).device
        self.last_update_tokens = 0

    def _forward(self, micro: DataProto) -> Tensor:
        """Values (b, R) fp32 at the columns predicting the response tokens (unmasked)."""
        batch = micro.batch
        assert batch is not None
        input_ids = batch["input_ids"].to(self.device)
        attention_mask = batch["attention_mask"].to(self.device)
        position_ids = batch["position_ids"].to(self.device)
        response_length = batch["responses"].shape[-1]
        packed = None
        if self.config.share_prompt_prefix and self.sp_size == 1:  # each distinct prompt forwarded once
            packed = pack_shared_prompts(
                input_ids,
                attention_mask,
                position_ids,
                response_length=response_length,
                mask_dtype=shared_prompt_mask_dtype(self.module),
            )
        if packed is None and (self.config.use_remove_padding or self.sp_size > 1):  # Ulysses shards the packed row
            packed = pack_sequences(input_ids, attention_mask, position_ids, response_length=response_length)
        if packed is not None:
            fwd = forward_packed(self.module, packed, sp_group=self.sp_group)  # logits (k, 1) at kept positions
            values = fwd.collect(fwd.outputs[:, 0].float())  # (K,)
            return scatter_response(values, packed, batch_size=input_ids.shape[0], response_length=response_length)
        trim = trim_padding_columns(input_ids, attention_mask, position_ids, response_length=response_length)
        out = self.module(
            input_ids=trim.input_ids,
            attention_mask=trim.attention_mask,
            position_ids=trim.position_ids,
            use_cache=False,
        )
        return trim.restore(out.logits[:, -trim.response_length - 1 : -1, 0].float())  # (b, R)

    def compute_values(self, data: DataProto, *, forward: ForwardPlan | None = None) -> Tensor:
        """Values (B, R), zero outside ``response_mask`` (as verl), in input order, on the input's device.

        Micro-batches as ``compute_log_prob`` of the actor: ``forward``, default ``plan.log_prob``.

        Args:
            data: ``input_ids``, ``attention_mask``, ``position_ids`` (B, T), ``responses``, ``response_mask`` (B, R).
        """
        _require(data, (*_FORWARD_KEYS, "response_mask"), "compute_values")

        def values(micro: DataProto) -> tuple[Tensor]:
            assert micro.batch is not None
            return (self._forward(micro) * micro.batch["response_mask"].to(self.device),)

        [out] = forward_micro_batches(
            data.select([*_FORWARD_KEYS, "response_mask"]),
            forward if forward is not None else self.plan.log_prob,
            values,
            dp_group=self.dp_group,
            sp_group=self.sp_group,
            out_device=data.tensors["input_ids"].device,
        )
        assert out is not None
        return out

    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Epochs x mini-batches (one optimizer step each) x micro-batches of the clipped value loss.

        Args:
            data: ``input_ids``, ``attention_mask``, ``position_ids`` (B, T); ``responses``, ``response_mask``,
                ``values`` (the critic's values at rollout time), ``returns`` (B, R).

        Returns:
            Global metrics: ``critic/vf_loss`` (mini-batch loss averaged over steps), ``critic/vf_clipfrac``,
            ``critic/vpred_mean`` (token-weighted), ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_step_frac``.

        Raises:
            ValueError: No optimizer, a missing key, or a batch that does not split into mini-batches.
        """
        if self.optimizer is None:
            raise ValueError("update_critic needs an optimizer; build it with build_optimizer(...).")
        _require(data, _UPDATE_KEYS, "update_critic")
        data = data.select(list(_UPDATE_KEYS))
        self.module.train()
        acc = MetricAccumulator(self.device)
        tokens = 0
        with ulysses_sequence_parallel(self.sp_group):  # across backward: checkpointing recomputes attention
            for _ in range(self.plan.ppo_epochs):
                minis = split_mini_batches(data, mini_batch_size=self.plan.mini_batch_size_per_rank, shuffle=False)
                for mini in minis:
                    tokens += self._update_mini_batch(mini, acc)
        self.last_update_tokens = tokens // self.sp_size
        return acc.reduce(group=self.dp_group)

    def _update_mini_batch(self, mini: DataProto, acc: MetricAccumulator) -> int:
        assert mini.batch is not None and self.optimizer is not None
        update = MiniBatchUpdate(
            "critic",
            self.module,
            self.optimizer,
            self.lr_scheduler,
            plan=self.plan,
            grad_clip=self.config.grad_clip,
            loss_scale=self.loss_scale,
            dp_group=self.dp_group,
            grad_sync_last_micro_batch=self.config.fsdp.grad_sync_last_micro_batch,
        )
        update.accumulate(mini, lambda micro, tokens, seqs: self._micro_batch_loss(micro, acc, tokens, seqs))
        update.step(acc)
        return int(mini.batch["attention_mask"].sum())

    def _micro_batch_loss(
        self, micro: DataProto, acc: MetricAccumulator, num_tokens: float, num_seqs: float
    ) -> Tensor:
        """This micro-batch's share of the mini-batch's clipped value loss (normalised by the global counts)."""
        batch = micro.batch
        assert batch is not None
        mask = batch["response_mask"].to(self.device)
        vpreds = self._forward(micro)
        vf_loss, vf_metrics = compute_value_loss(
            vpreds,
            batch["returns"].to(self.device),
            batch["values"].to(self.device),
            mask,
            cliprange_value=self.config.cliprange_value,
            loss_agg_mode=self.algorithm.loss_agg_mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            norm_len=float(mask.shape[-1]),
        )
        weight = mask.sum()
        acc.add_sum("critic/vf_loss", vf_loss.detach())
        acc.add_mean("critic/vf_clipfrac", vf_metrics["critic/vf_clipfrac"], weight)
        acc.add_mean("critic/vpred_mean", (vpreds.detach() * mask).sum() / weight.clamp(min=1), weight)
        return vf_loss
