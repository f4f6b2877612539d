"""Throw-away extension entries, outside the package, named by dotted path as a user's package would be.

Each one marks that it ran (a counter in the driver, a metric from a worker) so the recipe tests can tell it
went through the real path: config value -> validation -> dispatch -> a training step.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
from torch import Tensor

from rlhf_ops.algorithms import compute_policy_loss
from rlhf_ops.extensions import RolloutEngineSpec

CALLS: Counter[str] = Counter()  # driver-side entries count their calls here (the test runs the driver in-process)
KL_VALUE = 0.125  # the constant value of constant_value_kl: actor/kl_loss must equal it exactly


@torch.no_grad()
def centered_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, index: Any, gamma: float
) -> tuple[Tensor, Tensor]:
    """Score minus its group's mean, times gamma (group-based: it takes ``index``; ``gamma`` from algorithm.*).

    Shapes: (B, T) in and out.
    """
    CALLS["advantage"] += 1
    scores = token_level_rewards.sum(-1)
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(list(index)):
        groups.setdefault(uid, []).append(row)
    adv = torch.zeros_like(scores)
    for rows in groups.values():
        adv[rows] = scores[rows] - scores[rows].mean()
    adv = gamma * adv.unsqueeze(-1) * response_mask
    return adv, adv


def marked_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    entropy_coeff: float,
    **kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped loss plus a marker metric (``entropy_coeff`` is bound from algorithm.* by name)."""
    loss, metrics = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        **kwargs,
    )
    metrics["actor/test_policy_loss"] = torch.tensor(1.0 + entropy_coeff)
    return loss, metrics


def constant_value_kl(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """Value KL_VALUE on every token, gradient 1 (d/dlogprob): the loss's kl_loss metric shows it ran."""
    return logprob - logprob.detach() + KL_VALUE


def length_reward(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """1 for responses of at least 3 characters."""
    CALLS["reward"] += 1
    return float(len(solution_str) >= 3)


def build_marked_hf_engine(ctx: Any) -> Any:
    """The HF engine, plus a ``test_engine`` timing per call (logged as ``timing_s/worker/test_engine``); in this
    process (the driver, an evaluation) it counts its builds and calls in CALLS."""
    from workers.rollout.hf_rollout import build_engine

    CALLS["engine_built"] += 1
    engine = build_engine(ctx)
    generate = engine.generate_sequences

    def marked(prompts: Any, sampling: Any = None, step: int | None = None) -> Any:
        CALLS["engine_calls"] += 1
        start = time.perf_counter()
        out = generate(prompts, sampling, step)
        out.meta_info.setdefault("timing", {})["test_engine"] = time.perf_counter() - start
        return out

    engine.generate_sequences = marked  # type: ignore[method-assign]
    return engine


ENGINE = RolloutEngineSpec(
    name="marked_hf",
    target=build_marked_hf_engine,
    description="The HF engine with a timing marker (a test's throw-away engine).",
)
SYNC_ONLY_ENGINE = RolloutEngineSpec(name="sync_only", target=build_marked_hf_engine, multi_turn=False)


def missing_input_estimator(token_level_rewards: Tensor, response_mask: Tensor, critic_values: Tensor) -> Any:
    """Wrong signature: ``critic_values`` is neither an input the trainer passes nor an algorithm.* field."""
    return token_level_rewards, token_level_rewards
