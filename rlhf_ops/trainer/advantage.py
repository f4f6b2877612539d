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
)
from rlhf_ops.config.schema import AlgorithmConfig, KLControllerConfig
from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS
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
    """``{"advantages", "returns"}`` (B, R) fp32 for ``cfg.adv_estimator``, from ``token_level_rewards``.

    Dispatches from the estimator table (:data:`rlhf_ops.extensions.ADVANTAGE_ESTIMATORS`): the entry's traits
    say which inputs it takes (``index`` for group estimators, ``values`` with a critic, ``reward_baselines``
    for ReMax) and which ``algorithm.*`` fields it is given by name.
    """
    entry = ADVANTAGE_ESTIMATORS.get(cfg.adv_estimator)
    kwargs: dict[str, Any] = {
        "token_level_rewards": data.tensors["token_level_rewards"],
        "response_mask": data.tensors["response_mask"],
    }
    if entry.group:
        kwargs["index"] = data.non_tensor_batch.get("uid")
    if entry.needs_critic:
        kwargs["values"] = data.tensors["values"]
    if entry.needs_greedy_baseline:
        kwargs["reward_baselines"] = data.tensors["reward_baselines"]
    kwargs.update({name: getattr(cfg, name) for name in entry.config_params})
    adv, ret = entry.load()(**kwargs)
    return {"advantages": adv.float(), "returns": ret.float()}
