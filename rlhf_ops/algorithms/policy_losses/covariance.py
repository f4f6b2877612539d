"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv:2505.22617; verl's ``clip_cov`` / ``kl_cov``).

Shape notation: B: batch size (of this micro-batch), T: response length; every token-level input is (B, T).

Entropy collapses because the tokens with a large covariance between log-prob and advantage dominate the
update. Clip-Cov drops the loss of a small random share (``clip_cov_ratio``) of the tokens whose centred
covariance lies in ``(clip_cov_lb, clip_cov_ub)``; KL-Cov adds ``ppo_kl_coef * |log_prob - old_log_prob|`` to
the loss of the top ``kl_cov_ratio`` share of tokens by covariance (and uses the unclipped surrogate elsewhere).
The covariance is centred on the means of *this call's* tokens and the share is taken of its tokens, as in the
paper's and verl's code: the result depends on how a mini-batch is split into micro-batches (use one
micro-batch per mini-batch to reproduce the paper's per-batch selection).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_ops.algorithms.losses import Count, agg_loss, apply_is_weights
from rlhf_ops.algorithms.stats import masked_mean
from rlhf_ops.extensions.algorithms import LossAggMode, policy_loss


def _centred_covariance(advantages: Tensor, log_prob: Tensor, response_mask: Tensor) -> Tensor:
    """(B, T) per-token ``(A - mean A) * (log_prob - mean log_prob)``, means over the valid tokens; detached."""
    adv, logp = advantages.detach(), log_prob.detach()
    return (adv - masked_mean(adv, response_mask)) * (logp - masked_mean(logp, response_mask))


def _share(ratio: float, num_valid: int) -> int:
    # At least one token when any is valid (verl: max(int(ratio * n), 1)).
    return min(max(int(ratio * num_valid), 1), num_valid)


@policy_loss(
    "clip_cov",
    description="Clip-Cov: drops the loss of a few high-covariance tokens.",
    config_params=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    seeded=True,
)
def compute_policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    norm_len: float | None = None,
    is_weights: Tensor | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: the PPO clipped surrogate with the loss of a few high-covariance tokens removed.

    Candidates are valid tokens that PPO did not clip and whose centred covariance
    ``(A - mean A) * (log_prob - mean log_prob)`` lies strictly between ``clip_cov_lb`` and ``clip_cov_ub``;
    ``max(1, int(clip_cov_ratio * valid tokens))`` of them, drawn at random (``generator``), get a zero loss
    (no value, no gradient). No dual clip (as verl). See the module docstring for the micro-batch caveat.

    Args:
        old_log_prob: (B, T).
        log_prob: (B, T) carries the gradient.
        advantages: (B, T).
        response_mask: (B, T).
        clip_ratio_low: PPO lower clip epsilon.
        clip_ratio_high: PPO upper clip epsilon.
        clip_ratio_c: Unused (no dual clip); accepted so all ``POLICY_LOSSES`` share one call.
        loss_agg_mode: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        global_num_tokens: See ``agg_loss``.
        global_num_seqs: See ``agg_loss``.
        norm_len: See ``agg_loss``.
        is_weights: See :func:`rlhf_ops.algorithms.losses.compute_policy_loss`.
        clip_cov_ratio: Share of valid tokens whose loss is removed (paper: 2e-4).
        clip_cov_lb: Lower covariance bound of the candidates (paper: 1).
        clip_cov_ub: Upper covariance bound of the candidates (paper: 5).
        generator: Seeds the random choice among candidates (None: the global RNG).

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` (PPO clip), ``actor/cov_clipfrac`` (share of valid
        tokens whose loss was removed), ``actor/pg_clipfrac_lower`` (0) and ``actor/ppo_kl``.

    Raises:
        ValueError: ``clip_cov_ratio`` not in (0, 1], or ``clip_cov_lb >= clip_cov_ub``.
    """
    del clip_ratio_c
    if not 0.0 < clip_cov_ratio <= 1.0:
        raise ValueError(f"clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}.")
    if clip_cov_lb >= clip_cov_ub:
        raise ValueError(f"clip_cov_lb ({clip_cov_lb}) must be below clip_cov_ub ({clip_cov_ub}).")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    valid = response_mask > 0
    clipped_by_ppo = torch.gt(pg_losses2, pg_losses1) & valid
    cov = _centred_covariance(advantages, log_prob, response_mask)
    candidates = torch.nonzero(valid & ~clipped_by_ppo & (cov > clip_cov_lb) & (cov < clip_cov_ub))  # (K, 2)
    corr = torch.ones_like(pg_losses1)
    if len(candidates) > 0:
        num = min(_share(clip_cov_ratio, int(valid.sum())), len(candidates))
        pick = torch.randperm(len(candidates), generator=generator)[:num].to(candidates.device)
        chosen = candidates[pick]
        corr[chosen[:, 0], chosen[:, 1]] = 0.0
    pg_losses = apply_is_weights(torch.maximum(pg_losses1, pg_losses2) * corr, is_weights)
    pg_loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped_by_ppo.float(), response_mask).detach(),
        "actor/cov_clipfrac": masked_mean((corr == 0).float(), response_mask).detach(),
        "actor/pg_clipfrac_lower": torch.zeros((), device=pg_loss.device),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
    }
    return pg_loss, metrics


@policy_loss(
    "kl_cov",
    description="KL-Cov: a KL penalty on a few high-covariance tokens.",
    config_params=("kl_cov_ratio", "ppo_kl_coef"),
)
def compute_policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    norm_len: float | None = None,
    is_weights: Tensor | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped surrogate ``-A * ratio``, plus ``ppo_kl_coef * |log_prob - old|`` on top-cov tokens.

    The ``max(1, int(kl_cov_ratio * valid tokens))`` valid tokens with the largest centred covariance get the
    KL penalty (ties broken by position, as ``torch.topk``). No ratio clipping at all (the paper's recipe:
    the KL term is the only trust region). See the module docstring for the micro-batch caveat.

    Args:
        old_log_prob: (B, T).
        log_prob: (B, T) carries the gradient.
        advantages: (B, T).
        response_mask: (B, T).
        clip_ratio_low: Unused (no clipping); accepted so all ``POLICY_LOSSES`` share one call.
        clip_ratio_high: Unused, as ``clip_ratio_low``.
        clip_ratio_c: Unused, as ``clip_ratio_low``.
        loss_agg_mode: See :func:`rlhf_ops.algorithms.losses.agg_loss`.
        global_num_tokens: See ``agg_loss``.
        global_num_seqs: See ``agg_loss``.
        norm_len: See ``agg_loss``.
        is_weights: See :func:`rlhf_ops.algorithms.losses.compute_policy_loss`.
        kl_cov_ratio: Share of valid tokens that get the KL penalty (paper: 2e-3 for 7B, 2e-4 for 32B).
        ppo_kl_coef: Weight of the penalty (paper: 1).

    Returns:
        ``(pg_loss, metrics)`` with ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` (0: nothing is
        clipped), ``actor/kl_cov_frac`` (share of valid tokens penalised), ``actor/ppo_kl`` and
        ``actor/ppo_kl_abs`` (mean ``|log_prob - old|``).

    Raises:
        ValueError: ``kl_cov_ratio`` not in (0, 1].
    """
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    if not 0.0 < kl_cov_ratio <= 1.0:
        raise ValueError(f"kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}.")
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    abs_kl = negative_approx_kl.abs()
    valid = response_mask > 0
    penalised = torch.zeros_like(valid)
    num_valid = int(valid.sum())
    if num_valid > 0:
        flat_cov = _centred_covariance(advantages, log_prob, response_mask).masked_fill(~valid, -torch.inf)
        top = torch.topk(flat_cov.reshape(-1), _share(kl_cov_ratio, num_valid)).indices
        penalised.view(-1)[top] = True
    pg_losses = -advantages * ratio + ppo_kl_coef * abs_kl * penalised.to(ratio.dtype)
    pg_losses = apply_is_weights(pg_losses, is_weights)
    pg_loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        norm_len=norm_len,
    )
    zero = torch.zeros((), device=pg_loss.device)
    metrics = {
        "actor/pg_clipfrac": zero,
        "actor/pg_clipfrac_lower": zero,
        "actor/kl_cov_frac": masked_mean(penalised.float(), response_mask).detach(),
        "actor/ppo_kl": masked_mean(-negative_approx_kl, response_mask).detach(),
        "actor/ppo_kl_abs": masked_mean(abs_kl, response_mask).detach(),
    }
    return pg_loss, metrics
