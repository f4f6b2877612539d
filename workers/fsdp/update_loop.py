"""What the actor's and the critic's updates share: one optimizer step over a mini-batch of micro-batches.

Notation: B = rows of the mini-batch on this rank, R = response length.

Each role supplies only the loss of one micro-batch (the policy loss, the clipped value loss); the
:class:`MiniBatchUpdate` counts the mini-batch's valid tokens and sequences over the dp group, splits it into
micro-batches (fixed rows or a token budget, ``rlhf_ops.config.batch_plan.PPOPlan``), runs backward on each
scaled loss (gradient accumulation) and takes the clipped optimizer step with its ``<role>/*`` metrics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_ops.config.batch_plan import PPOPlan
from rlhf_ops.protocol import DataProto
from workers.fsdp.optim import clipped_optimizer_step
from workers.fsdp.precision import keep_autocast_casts
from workers.utils.dist import MetricAccumulator, global_counts
from workers.utils.micro_batch import make_micro_batches

__all__ = ["MicroLoss", "MiniBatchUpdate"]

# (micro-batch, global valid tokens of the mini-batch, global sequences of the mini-batch) -> the micro-batch's
# share of the mini-batch loss (already normalised by those global counts).
MicroLoss = Callable[[DataProto, float, float], Tensor]


class MiniBatchUpdate:
    """Gradient accumulation over one mini-batch and its optimizer step, for the role named ``role``.

    Args:
        role: Metric prefix (``actor``, ``critic``).
        module: The trained module (FSDP2-wrapped or plain).
        optimizer: Its optimizer.
        lr_scheduler: Stepped after every optimizer step.
        plan: The role's per-rank sizes (micro-batch rows or token budget).
        grad_clip: Max global gradient norm.
        loss_scale: ``dp_size x sp_size`` (see :meth:`accumulate`).
        dp_group: The data-parallel group the counts and the token-budget split are reduced over.
        grad_sync_last_micro_batch: FSDP2 modules: reduce-scatter the gradients only after the last micro-batch's
            backward (``fsdp.grad_sync_last_micro_batch``); the others accumulate unsharded gradients.
    """

    def __init__(
        self,
        role: str,
        module: nn.Module,
        optimizer: Optimizer,
        lr_scheduler: LRScheduler | None,
        *,
        plan: PPOPlan,
        grad_clip: float,
        loss_scale: int,
        dp_group: dist.ProcessGroup | None,
        grad_sync_last_micro_batch: bool = False,
    ) -> None:
        self.role, self.module, self.optimizer, self.lr_scheduler = role, module, optimizer, lr_scheduler
        self.plan, self.grad_clip, self.loss_scale, self.dp_group = plan, grad_clip, loss_scale, dp_group
        self.sync_once = grad_sync_last_micro_batch and isinstance(module, FSDPModule)

    def accumulate(self, mini: DataProto, micro_loss: MicroLoss) -> None:
        """Backward of every micro-batch's loss of ``mini`` (``response_mask`` (B, R) needed); no step yet.

        A collective under FSDP: every rank of the dp group must call it for the same mini-batch index.
        """
        assert mini.batch is not None
        num_tokens, num_seqs = global_counts(mini.batch["response_mask"], group=self.dp_group)
        micro_batches, _ = make_micro_batches(
            mini,
            use_dynamic_bsz=self.plan.use_dynamic_bsz,
            micro_batch_size=self.plan.micro_batch_size_per_rank,
            max_token_len=self.plan.max_token_len_per_rank,
            dp_group=self.dp_group,
        )
        # Gradient accumulation: backward per micro-batch, one optimizer step per mini-batch. Each micro-batch's
        # loss is normalised by the mini-batch's global counts (num_tokens, num_seqs), not its own, so the
        # accumulated gradient is the same however the mini-batch was split (rows per micro-batch, ranks).
        # CPU autocast on plain parameters: the weights are cast to bf16 once per mini-batch, not per micro-batch.
        with keep_autocast_casts(self.module):
            for index, micro in enumerate(micro_batches):
                if self.sync_once:  # every rank has the same number of micro-batches: the same one reduces
                    # A reduce-scatter of the summed gradients equals the sum of per-micro-batch reduce-scatters.
                    self.module.set_requires_gradient_sync(index == len(micro_batches) - 1)  # type: ignore[operator]
                loss = micro_loss(micro, num_tokens, num_seqs)
                # The loss is already a global mean, so the wanted gradient is the sum over ranks; FSDP averages
                # the gradients over the dp x sp ranks holding the shards; multiplying by their number undoes it.
                (loss * self.loss_scale).backward()

    def step(self, acc: MetricAccumulator) -> None:
        """Clipped optimizer step (skipped on a non-finite norm); adds ``<role>/grad_norm``, ``<role>/lr`` and
        ``<role>/skipped_step_frac``."""
        result = clipped_optimizer_step(self.module, self.optimizer, self.lr_scheduler, max_norm=self.grad_clip)
        acc.num_steps += 1
        acc.add_step(f"{self.role}/grad_norm", result.grad_norm)
        acc.add_step(f"{self.role}/lr", result.lr)
        acc.add_step(f"{self.role}/skipped_step_frac", float(result.skipped))

    def drop(self, acc: MetricAccumulator) -> None:
        """Discards the accumulated gradient without a step (its loss metrics still count as one step)."""
        self.optimizer.zero_grad(set_to_none=True)
        acc.num_steps += 1
