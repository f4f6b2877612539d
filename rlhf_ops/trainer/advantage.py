"""The driver's advantage stage: KL in the reward (if configured), then the advantage estimator.

Notation: B = sequences in the step (prompts x n), R = response length.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf_ops.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from rlhf_ops.config.schema import AlgorithmConfig, KLControllerConfig
from rlhf_ops.protocol import DataProto


def build_kl_controller(cfg: KLControllerConfig) -> KLController:
    """The reward-KL coefficient controller of ``algorithm.kl_ctrl``."""
    if cfg.type == "adaptive":
        return AdaptiveKLController(init_kl_coef=cfg.kl_coef, target_kl=cfg.target_kl, horizon=cfg.horizon)
    return FixedKLController(kl_coef=cfg.kl_coef)


def apply_reward_kl(
    data: DataProto, cfg: AlgorithmConfig, kl_ctrl: KLController
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """``{"token_level_rewards": (B, R)}``: scores minus beta * KL when ``use_kl_in_reward``, else the scores;
    and the KL metrics (the adaptive controller is updated with this step's KL)."""
    scores = data.tensors["token_level_scores"]
    if not cfg.use_kl_in_reward:
        return {"token_level_rewards": scores}, {}
    rewards, metrics = apply_kl_penalty(
        scores,
        data.tensors["old_log_probs"],
        data.tensors["ref_log_prob"],
        data.tensors["response_mask"],
        kl_ctrl=kl_ctrl,
        kl_penalty=cfg.kl_penalty,
    )
    return {"token_level_rewards": rewards}, {k: float(v) for k, v in metrics.items()}


def compute_advantage(data: DataProto, cfg: AlgorithmConfig) -> dict[str, Tensor]:
    """``{"advantages", "returns"}`` (B, R) fp32 for ``cfg.adv_estimator``, from ``token_level_rewards``."""
    rewards, mask = data.tensors["token_level_rewards"], data.tensors["response_mask"]
    name = cfg.adv_estimator
    index: Any = data.non_tensor_batch.get("uid")
    if name == "gae":
        adv, ret = compute_gae_advantage_return(rewards, data.tensors["values"], mask, cfg.gamma, cfg.lam)
    elif name == "grpo":
        adv, ret = compute_grpo_outcome_advantage(
            rewards, mask, index, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo
        )
    elif name == "rloo":
        adv, ret = compute_rloo_outcome_advantage(rewards, mask, index)
    elif name == "reinforce_plus_plus":
        adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, cfg.gamma)
    elif name == "reinforce_plus_plus_baseline":
        adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    elif name == "remax":
        adv, ret = compute_remax_outcome_advantage(rewards, data.tensors["reward_baselines"], mask)
    else:  # the config's Literal makes this unreachable
        raise AssertionError(name)
    return {"advantages": adv.float(), "returns": ret.float()}
