"""Every policy loss, one module per family, and the call they share (:class:`PolicyLossFn`).

Shape notation: B: batch size (of this micro-batch), T: response length; every token-level input is (B, T).
All of them aggregate their token losses with :func:`rlhf_ops.algorithms.losses.agg_loss` under one
``loss_agg_mode`` (:data:`rlhf_ops.extensions.algorithms.LossAggMode`, the values of ``algorithm.loss_agg_mode``).

- :mod:`.ppo`: PPO's clipped surrogate with dual clip (``vanilla``) and GSPO's sequence-level ratio (``gspo``);
- :mod:`.covariance`: Clip-Cov and KL-Cov (``clip_cov``, ``kl_cov``);
- :mod:`.cispo`: CISPO's clipped, detached importance weight (``cispo``).

A new built-in loss is one function with :func:`rlhf_ops.extensions.algorithms.policy_loss` on it, in a
module of this package (a new module is found without an import here): the table reads the decorator from
the source.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from rlhf_ops.algorithms.losses import Count
from rlhf_ops.algorithms.policy_losses.cispo import compute_policy_loss_cispo
from rlhf_ops.algorithms.policy_losses.covariance import compute_policy_loss_clip_cov, compute_policy_loss_kl_cov
from rlhf_ops.algorithms.policy_losses.ppo import compute_policy_loss, compute_policy_loss_gspo
from rlhf_ops.algorithms.rollout_correction import truncated_is_weights
from rlhf_ops.extensions.algorithms import POLICY_LOSSES as POLICY_LOSS_TABLE
from rlhf_ops.extensions.algorithms import LossAggMode

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossFn",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "truncated_is_weights",
]


class PolicyLossFn(Protocol):
    """Call signature shared by the entries of ``POLICY_LOSSES`` (variant hyper-parameters bound beforehand)."""

    def __call__(
        self,
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        *,
        clip_ratio_low: float,
        clip_ratio_high: float,
        clip_ratio_c: float = 3.0,
        loss_agg_mode: LossAggMode = ...,
        global_num_tokens: Count = None,
        global_num_seqs: Count = None,
        norm_len: float | None = None,
        is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


# The built-in entries of the table (rlhf_ops.extensions.POLICY_LOSSES), name -> function; the actor binds
# an entry's own hyper-parameters from the config (workers.actor.dp_actor.bind_policy_loss).
POLICY_LOSSES: dict[str, PolicyLossFn] = {entry.name: entry.load() for entry in POLICY_LOSS_TABLE}
