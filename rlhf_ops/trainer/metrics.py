"""Step metrics under verl's names, computed on the driver from the step's batch.

Notation: B = sequences in the step, P = prompt length, R = response length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlhf_ops.agent.metrics import multi_turn_metrics
from rlhf_ops.protocol import DataProto


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def _masked_values(t: Tensor, mask: Tensor) -> Tensor:
    return t[mask.bool()]


def compute_data_metrics(batch: DataProto, *, max_response_length: int, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a trained batch."""
    b = batch.tensors
    response_mask = b["response_mask"]
    response_length = response_mask.sum(-1).float()  # (B,)
    prompt_length = b["attention_mask"][:, : -response_mask.shape[1]].sum(-1).float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", b["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", _masked_values(b["advantages"], response_mask)))
    metrics.update(_stats("critic/returns", _masked_values(b["returns"], response_mask)))
    if use_critic:
        values = _masked_values(b["values"], response_mask)
        returns = _masked_values(b["returns"], response_mask)
        metrics.update(_stats("critic/values", values))
        var_returns = torch.var(returns)
        metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (var_returns + 1e-5)).item()
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length >= max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics.update(multi_turn_metrics(b))  # num_turns/*, tool_call_counts/*: multi-turn rollouts only
    return metrics


def compute_throughput_metrics(*, num_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """Tokens (prompt + response, valid only) per second per rank over the whole step."""
    return {
        "perf/total_num_tokens": float(num_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": num_tokens / max(step_seconds, 1e-9) / world_size,
    }


def compute_rollout_probs_diff(
    rollout_log_probs: Tensor, actor_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the actor's recomputed ones (verl's names).

    verl's ``calculate_debug_metrics``: on probabilities, not log-probs, so near-zero-probability tokens
    (whose log-probs can differ by a lot while both engines agree the token is unlikely) do not dominate.
    A value far above fp noise means the engine does not run the actor's weights (a failed weight sync, a
    dtype mismatch) and every importance ratio of the update is off.

    Args:
        rollout_log_probs: (B, R) log-probs the engine reported for the sampled tokens.
        actor_log_probs: (B, R) the actor's teacher-forced log-probs of the same tokens (``old_log_probs``),
            at the same temperature (the engine reports temperature-1 log-probs: compare at temperature 1).
        response_mask: (B, R) 1 on response tokens (the EOS included), 0 on padding.

    Returns:
        ``training/rollout_probs_diff_{max,mean,std}`` of ``|exp(rollout) - exp(actor)|`` over the masked
        tokens, and ``training/rollout_actor_probs_pearson_corr`` of the two probability vectors; ``{}``
        when no token is masked in.
    """
    if not rollout_log_probs.shape == actor_log_probs.shape == response_mask.shape:
        raise ValueError(
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, actor_log_probs {tuple(actor_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must all be (B, R)."
        )
    keep = response_mask.bool()
    rollout = torch.exp(rollout_log_probs.detach().double())[keep]  # (N,) N = response tokens
    actor = torch.exp(actor_log_probs.detach().double().to(rollout_log_probs.device))[keep]
    if rollout.numel() == 0:
        return {}
    diff = (rollout - actor).abs()
    metrics = {
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0,
    }
    centred_r, centred_a = rollout - rollout.mean(), actor - actor.mean()
    denom = (centred_r.norm() * centred_a.norm()).item()
    if denom > 0:  # undefined when either side is constant (e.g. one token)
        metrics["training/rollout_actor_probs_pearson_corr"] = (centred_r @ centred_a).item() / denom
    return metrics


def reduce_worker_metrics(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean over ranks of each metric (workers already reduced over their micro-batches); ``memory/*`` peaks
    take the maximum over ranks (the rank that runs out of memory first is the one that matters)."""
    keys = sorted({k for m in per_rank for k in m})
    out: dict[str, float] = {}
    for key in keys:
        values = [float(m[key]) for m in per_rank if key in m]
        out[key] = float(np.max(values)) if key.startswith("memory/") else float(np.mean(values))
    return out


def log_profile_traces(logger: Any, profile_dir: str, *, step: int) -> list[str]:
    """Logs every trace the workers wrote for ``step`` (``<profile_dir>/step_<step>/*.json``) as an artifact
    ``profiles/step_<step>/<file>``; returns the artifact paths. The folder must be readable from the driver
    (a single node, or a shared file system as for checkpoints)."""
    from pathlib import Path

    folder = Path(profile_dir) / f"step_{step}"
    logged = []
    for trace in sorted(folder.glob("*.json")):
        artifact = f"profiles/step_{step}/{trace.name}"
        logger.log_text(trace.read_text(encoding="utf-8"), artifact)
        logged.append(artifact)
    return logged


def compute_reward_metrics_by_source(
    scores: Tensor, data_sources: Sequence[str], *, prefix: str, extra: Mapping[str, Sequence[float]] | None = None
) -> dict[str, float]:
    """``<prefix>/<source>/reward/mean`` (and the mean of every extra reward key) per data source."""
    out: dict[str, float] = {}
    sources = np.asarray(data_sources, dtype=object)
    for source in sorted(set(sources.tolist())):
        idx = torch.as_tensor(np.nonzero(sources == source)[0])
        out[f"{prefix}/{source}/reward/mean"] = scores[idx].float().mean().item()
        for key, values in (extra or {}).items():
            if key == "score":
                continue
            arr = np.asarray(values, dtype=np.float64)[idx.numpy()]
            out[f"{prefix}/{source}/{key}/mean"] = float(arr.mean())
    return out


ROLLOUT_DIFF_MAX, ROLLOUT_DIFF_MEAN = "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean"


def rollout_probs_diff_stats(
    rollout_log_probs: Tensor, actor_log_probs: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Mergeable parts of :func:`compute_rollout_probs_diff`: (max, sum, count) of ``|exp(rollout) - exp(actor)|``
    over the response tokens, 0-dim fp32 tensors (the on-policy update computes them per micro-batch).

    Micro-batches or ranks merge as the max of maxes and sum / count of the summed sums and counts.
    """
    mask = response_mask.bool()
    diff = (rollout_log_probs.float().exp() - actor_log_probs.detach().float().exp()).abs()[mask]  # (N,)
    top = diff.max() if diff.numel() else torch.zeros((), device=diff.device)
    return top, diff.sum(), torch.tensor(float(diff.numel()), device=diff.device)
