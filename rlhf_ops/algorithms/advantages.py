"""Advantage estimators with verl-compatible names, signatures and numerics.

Shape notation: B: batch size (all samples, n per prompt), T: response length, G: number of groups
(prompts). Every estimator returns ``(advantages, returns)``, both (B, T) and computed without grad.
Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) reduce the token rewards to one score per
sequence (their sum over T) and compare it with the other samples of the same prompt, named by
``index`` (the ``uid`` column: one hashable group id per row).

Each estimator is declared by :func:`rlhf_ops.extensions.algorithms.advantage_estimator` with its traits:
that decorator is the whole registration (the table reads it from this file without importing torch).

Observation spans: in a multi-turn response the mask has holes (tool and environment tokens are 0 inside
the response). Every estimator treats a masked token as "not an action": GAE and REINFORCE++ carry their
running value across it, and the outcome estimators broadcast their advantage onto model tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from rlhf_ops.algorithms.stats import masked_whiten
from rlhf_ops.extensions.algorithms import ADVANTAGE_ESTIMATORS as ADVANTAGE_ESTIMATOR_TABLE
from rlhf_ops.extensions.algorithms import advantage_estimator

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]


@advantage_estimator(
    "gae", description="PPO's GAE over critic values.", needs_critic=True, config_params=("gamma", "lam")
)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015) as verl computes it.

    Walks the response backwards; on masked tokens (observation or padding) the TD error is skipped and
    the running value and GAE carry over unchanged. ``returns = advantages + values`` is computed before
    whitening; the advantages are then whitened over the mask (verl default).

    Args:
        token_level_rewards: (B, T) reward per token (usually the score on the last token minus KL).
        values: (B, T) critic values.
        response_mask: (B, T) 1 on response tokens.
        gamma: Discount factor.
        lam: GAE lambda.
        whiten: Whiten the advantages over the mask (verl always does); False returns the raw GAE.

    Returns:
        ``(advantages, returns)``, both (B, T).
    """
    mask = response_mask.to(values.dtype)
    next_values = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # Masked tokens keep the values of the next valid token: they do not break the recursion.
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _group_ids(index: Any, batch_size: int) -> tuple[Tensor, int]:
    """Map arbitrary hashable group ids (uids) to dense ints 0..G-1 in order of first appearance."""
    items: Iterable[Any] = index.tolist() if isinstance(index, Tensor) else index
    dense: dict[Any, int] = {}
    ids = [dense.setdefault(item, len(dense)) for item in items]
    if len(ids) != batch_size:
        raise ValueError(
            f"index has {len(ids)} group ids but the batch has {batch_size} rows: pass one uid per row "
            "(the non-tensor 'uid' column after repeat(n, interleave=True))."
        )
    return torch.tensor(ids, dtype=torch.long), len(dense)


def _group_stats(scores: Tensor, index: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row group mean, unbiased std and size; size-1 groups get mean 0 and std 1 (verl).

    Args:
        scores: (B,) one score per sequence.
        index: B group ids.

    Returns:
        ``(mean, std, count)``, each (B,), the statistics of the row's group.
    """
    gid, num_groups = _group_ids(index, scores.shape[0])
    gid = gid.to(scores.device)
    out_dtype = scores.dtype
    scores = scores.to(torch.promote_types(out_dtype, torch.float32))  # group counts must stay exact
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, gid, torch.ones_like(scores)
    )
    sums = torch.zeros_like(counts).index_add_(0, gid, scores)
    means = sums / counts
    sq_dev = torch.zeros_like(counts).index_add_(0, gid, (scores - means[gid]) ** 2)
    stds = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    single = counts == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)
    return means[gid].to(out_dtype), stds[gid].to(out_dtype), counts[gid].to(out_dtype)


@advantage_estimator(
    "grpo",
    description="Score minus the group mean, over the group std (Dr.GRPO without the std).",
    group=True,
    config_params=("norm_adv_by_std_in_grpo",),
)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage: the sequence score minus its group mean, divided by the group std.

    ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the unbiased std of the group; with
    ``norm_adv_by_std_in_grpo=False`` (Dr.GRPO, arXiv:2503.20783) ``A_i = s_i - mean_g``. A group of one
    sample uses mean 0 and std 1, as verl. The advantage is broadcast to every response token.

    Args:
        token_level_rewards: (B, T); the score of a sequence is its sum over T.
        response_mask: (B, T).
        index: B hashable group ids (numpy array, list of str/int, or a 1-D tensor).
        epsilon: Added to the std to avoid division by zero.
        norm_adv_by_std_in_grpo: Divide by the group std (GRPO) or not (Dr.GRPO).

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _ = _group_stats(scores, index)
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@advantage_estimator("rloo", description="Score minus the mean of the other samples of the group.", group=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """RLOO outcome advantage (arXiv:2402.14740): score minus the mean of the *other* samples of the group.

    For a group of size n > 1, ``s_i - mean_{j != i} s_j = (s_i - mean_g) * n / (n - 1)``; a group of one
    keeps its raw score (verl).

    Args:
        token_level_rewards: (B, T); the score of a sequence is its sum over T.
        response_mask: (B, T).
        index: B hashable group ids.
        epsilon: Unused; kept for verl signature compatibility.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    del epsilon
    scores = token_level_rewards.sum(dim=-1)
    mean, _, n = _group_stats(scores, index)
    factor = n / (n - 1).clamp(min=1)
    # Same expression as verl (s*n/(n-1) - mean*n/(n-1)) so results match bit for bit.
    adv = torch.where(n > 1, scores * factor - mean * factor, scores)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@advantage_estimator(
    "reinforce_plus_plus", description="Discounted reward-to-go, whitened over the batch.", config_params=("gamma",)
)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted reward-to-go, whitened over the batch.

    The time steps are the model's tokens (``response_mask`` 1). A masked token (an observation inside a
    multi-turn response, or padding) is not an action: the running return crosses it unchanged (no
    discount, its reward ignored), so a reward at the end of a multi-turn response reaches the model tokens
    before every tool output. On a contiguous mask this equals verl's "reset after EOS" on every model
    token; masked tokens get the return of the next model token (0 on trailing padding).

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T) 1 on model tokens; may have holes (observation spans).
        gamma: Discount factor per model token.

    Returns:
        ``advantages`` (B, T), the whitened returns (zero on masked tokens), and ``returns`` (B, T).
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        stepped = token_level_rewards[:, t] + gamma * running
        running = stepped * mask[:, t] + (1 - mask[:, t]) * running  # masked: carry over unchanged
        returns[:, t] = running
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@advantage_estimator(
    "reinforce_plus_plus_baseline", description="Group-mean baseline, whitened over the batch.", group=True
)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): group-mean baseline, then whitening over the whole batch.

    Args:
        token_level_rewards: (B, T); the score of a sequence is its sum over T.
        response_mask: (B, T).
        index: B hashable group ids.
        epsilon: Unused; kept for verl signature compatibility.

    Returns:
        ``(advantages, returns)``, both (B, T) and equal.
    """
    del epsilon
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = _group_stats(scores, index)
    adv = (scores - mean).unsqueeze(-1).expand_as(token_level_rewards) * response_mask
    adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


@advantage_estimator(
    "remax", description="Reward-to-go minus the reward of the greedy response.", needs_greedy_baseline=True
)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    reward_baselines: Tensor,
    response_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """ReMax (arXiv:2310.10505): reward-to-go minus the reward of the greedy response.

    Args:
        token_level_rewards: (B, T).
        reward_baselines: (B,) reward of the greedy (argmax) response to the same prompt.
        response_mask: (B, T).

    Returns:
        ``(advantages, returns)``, both (B, T); ``returns`` is the undiscounted reward-to-go of the model
        tokens (rewards on masked tokens are ignored; a masked token holds the return of the next model
        token); ``advantages`` are 0 on masked tokens, observation spans inside the response included.
    """
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return advantages, returns


# The built-in entries of the table (rlhf_ops.extensions.ADVANTAGE_ESTIMATORS), name -> function: the table
# states each one's traits and the trainer dispatches from it; this view is for callers that want the functions.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {entry.name: entry.load() for entry in ADVANTAGE_ESTIMATOR_TABLE}


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` needs critic values (its table entry's ``needs_critic``).

    Raises:
        ValueError: If ``name`` is not a built-in estimator.
    """
    entry = ADVANTAGE_ESTIMATOR_TABLE.known(name)
    if entry is None:
        raise ValueError(f"adv_estimator={name!r} is unknown; valid values: {sorted(ADVANTAGE_ESTIMATORS)}.")
    return entry.needs_critic
