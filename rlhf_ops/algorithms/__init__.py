"""Pure-torch RL algorithms: advantage estimators, KL, policy / value losses (PPO, GSPO, Clip-Cov, KL-Cov,
CISPO), truncated importance sampling, aggregation, entropy.

Shape notation: B: batch size, T: response length, V: vocab size. Imports torch only (no Ray, vLLM or
transformers), so the driver and the workers share one implementation. Names and numerics follow verl's
``trainer/ppo/core_algos.py`` so recipes port unchanged.
"""

from __future__ import annotations

from rlhf_ops.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageFn,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    needs_critic,
)
from rlhf_ops.algorithms.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_penalty,
)
from rlhf_ops.algorithms.logits import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from rlhf_ops.algorithms.losses import LOSS_AGG_MODES, agg_loss, apply_is_weights, compute_value_loss
from rlhf_ops.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLossFn,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
)
from rlhf_ops.algorithms.rollout_correction import truncated_is_weights
from rlhf_ops.algorithms.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageFn",
    "FixedKLController",
    "KLController",
    "PolicyLossFn",
    "agg_loss",
    "apply_is_weights",
    "apply_kl_penalty",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "entropy_from_logits",
    "kl_penalty",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "needs_critic",
    "truncated_is_weights",
]
