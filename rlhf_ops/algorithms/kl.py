"""KL estimators, KL coefficient controllers, and the KL-in-reward penalty (verl semantics).

Shape notation: B: batch size, T: response length. Log-probs are per token, (B, T).

Estimators (J. Schulman, "Approximating KL divergence", 2020), with ``d = logprob - ref_logprob``:
``kl``/``k1``: d; ``abs``: |d|; ``mse``/``k2``: d^2 / 2; ``low_var_kl``/``k3``: exp(-d) + d - 1, clamped
to [-10, 10]. A trailing ``+`` (e.g. ``k3+``) keeps the forward value of the named estimator but takes
the gradient of k2, whose gradient is the unbiased one (straight-through, arXiv:2505.17508).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from rlhf_ops.algorithms.stats import masked_mean
from rlhf_ops.extensions.algorithms import KL_ESTIMATORS, kl_estimator

# The built-in names of the table (rlhf_ops.extensions.KL_ESTIMATORS): the estimators below and their '+' forms.
KL_PENALTY_NAMES: tuple[str, ...] = tuple(e.name for e in KL_ESTIMATORS if e.target.startswith(f"{__name__}:"))


@kl_estimator("kl", "k1", description="log-ratio (k1)")
def kl_k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k1: the log-ratio ``d``."""
    return logprob - ref_logprob


@kl_estimator("abs", description="absolute log-ratio")
def kl_abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """The absolute log-ratio ``|d|``."""
    return (logprob - ref_logprob).abs()


@kl_estimator("mse", "k2", description="half squared log-ratio (k2)")
def kl_k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k2: ``d^2 / 2``."""
    return 0.5 * (logprob - ref_logprob).square()


@kl_estimator("low_var_kl", "k3", description="exp(-d) + d - 1, clamped (k3)")
def kl_k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """k3: ``exp(-d) + d - 1``, clamped to [-10, 10]."""
    # Clamps as verl: the inner one keeps exp() finite, the outer one bounds rare huge estimates.
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    kld = torch.exp(log_ratio) - log_ratio - 1
    return torch.clamp(kld, min=-10, max=10)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Token-level estimate of KL(pi || pi_ref) from sampled-token log-probs.

    Args:
        logprob: (B, T) log-probs of the sampled tokens under the current (or rollout) policy.
        ref_logprob: (B, T) log-probs of the same tokens under the reference policy.
        kl_penalty: An entry of the KL table: ``KL_PENALTY_NAMES`` (see the module docstring), a registered
            name or a user's dotted path ``fn(logprob, ref_logprob)``.

    Returns:
        (B, T) estimate; not masked.

    Raises:
        ValueError: If ``kl_penalty`` is not a known name.
    """
    if ":" not in kl_penalty and kl_penalty not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty={kl_penalty!r} is unknown; valid values: {list(KL_PENALTY_NAMES)}.")
    entry = KL_ESTIMATORS.get(kl_penalty)
    estimator: Any = entry.load()
    forward: Tensor = estimator(logprob, ref_logprob)
    if not entry.straight_through:
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    # Value of `forward`, gradient of k2.
    return k2 - k2.detach() + forward.detach()


class KLController(Protocol):
    """What the trainer needs from a KL coefficient controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _load_value(state: dict[str, Any]) -> float:
    if "value" not in state:
        raise ValueError(f"KL controller state has no 'value' key (got keys {sorted(state)}); pass state_dict().")
    return float(state["value"])


class FixedKLController:
    """Constant KL coefficient.

    Args:
        kl_coef: The coefficient beta.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers are used the same way."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint: ``{"value": float}``."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        self.value = _load_value(state)


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593), verl's update rule.

    Each update multiplies the coefficient by ``1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``.

    Args:
        init_kl_coef: Initial coefficient.
        target_kl: KL the controller steers towards; > 0.
        horizon: Number of samples over which the error is corrected; > 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}.")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping ``current_kl`` at the target.

        Args:
            current_kl: Measured KL of the last batch.
            n_steps: Number of samples in that batch.
        """
        proportional_error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """State to save in a checkpoint; only ``value`` is restored (target and horizon come from config)."""
        return {"value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        self.value = _load_value(state)


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    *,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """Subtract a KL penalty from the token scores and update the controller (verl ``apply_kl_penalty``).

    ``rewards = scores - beta * kl * mask`` with beta the coefficient *before* this update. The KL fed to
    the controller is the masked token mean per sequence, averaged over the batch; the controller is
    updated with ``n_steps = B``.

    Args:
        token_level_scores: (B, T) reward-model / rule scores.
        old_log_prob: (B, T) log-probs of the actor that generated the batch.
        ref_log_prob: (B, T) log-probs of the reference policy.
        response_mask: (B, T).
        kl_ctrl: Controller holding beta; mutated.
        kl_penalty: Estimator name, see :func:`kl_penalty`.

    Returns:
        ``(token_level_rewards, metrics)`` with rewards (B, T) and the metrics
        ``actor/reward_kl_penalty`` (the KL) and ``actor/reward_kl_penalty_coeff`` (beta used).
    """
    kld = _penalty(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean(dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


# apply_kl_penalty's `kl_penalty` argument shadows the function of the same name (verl's spelling).
_penalty = kl_penalty
