"""The algorithm tables: advantage estimators, policy losses and KL estimators.

Each entry states what the trainer and the validation ask of it; the code itself is named by a
``"module:attribute"`` string and imported only when a step runs, so this module (and the config that reads
it) stays torch-free. A built-in entry's traits agree with its function's signature (a unit test checks
every one); a user's plain function gets its traits from its signature (:func:`estimator_from_callable`).

Call conventions (keywords, so an estimator takes only what it needs):

- an advantage estimator takes ``token_level_rewards`` and ``response_mask`` (B, T), and may take ``index``
  (the B group ids: group-based), ``values`` (B, T critic values: needs a critic), ``reward_baselines``
  (B,: ReMax's greedy-response reward) and any ``algorithm.*`` field by its name (``gamma``, ``lam``...);
  it returns ``(advantages, returns)``, both (B, T);
- a policy loss has :class:`rlhf_ops.algorithms.policy_losses.PolicyLossFn`'s signature; its own
  hyper-parameters are ``algorithm.*`` fields bound by name (``config_params``), and ``generator`` (a seeded
  ``torch.Generator``) when ``seeded``;
- a user's KL estimator is ``fn(logprob, ref_logprob) -> (B, T)`` (the built-ins share
  :func:`rlhf_ops.algorithms.kl.kl_penalty`, which reads the name).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from rlhf_ops.extensions.table import Entry, Table

# What the trainer hands an advantage estimator besides algorithm.* fields (see the module docstring).
ADVANTAGE_INPUTS = ("token_level_rewards", "response_mask", "index", "values", "reward_baselines")
# The keywords every policy loss is called with (PolicyLossFn); any other keyword is a bound hyper-parameter.
POLICY_LOSS_CALL = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_agg_mode",
    "global_num_tokens",
    "global_num_seqs",
    "norm_len",
    "is_weights",
)


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimator(Entry):
    """An advantage estimator (``algorithm.adv_estimator``).

    Attributes:
        group: Compares the samples of one prompt (takes ``index``): needs ``rollout.n >= 2``.
        needs_critic: Takes critic ``values``: the run builds a critic (a value model trained beside the actor).
        needs_greedy_baseline: Takes ``reward_baselines``: the trainer decodes one greedy response per prompt.
        config_params: ``algorithm.*`` fields passed by name (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``).
    """

    group: bool = False
    needs_critic: bool = False
    needs_greedy_baseline: bool = False
    config_params: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PolicyLoss(Entry):
    """A policy loss (``algorithm.policy_loss``).

    Attributes:
        config_params: ``algorithm.*`` fields bound by keyword (Clip-Cov's ``clip_cov_ratio``...).
        seeded: Takes ``generator``: the actor binds one seeded ``torch.Generator`` for its life.
    """

    config_params: tuple[str, ...] = ()
    seeded: bool = False


@dataclass(frozen=True, kw_only=True)
class KLEstimator(Entry):
    """A KL estimator (``algorithm.kl_penalty`` in the reward, ``algorithm.kl_loss_type`` in the loss)."""


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no readable signature: nothing can be inferred
        return {}


def estimator_from_callable(name: str, fn: Any) -> AdvantageEstimator:
    """A user's plain estimator function: traits from its parameter names; other parameters that have no
    default are passed by name from ``algorithm.*`` (the pre-flight refuses names that are no field)."""
    params = _parameters(fn)
    required_extra = tuple(
        p
        for p, spec in params.items()
        if p not in ADVANTAGE_INPUTS
        and spec.default is inspect.Parameter.empty
        and spec.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )
    return AdvantageEstimator(
        name=name,
        target=fn,
        description=(inspect.getdoc(fn) or "").split("\n")[0],
        group="index" in params,
        needs_critic="values" in params,
        needs_greedy_baseline="reward_baselines" in params,
        config_params=required_extra,
    )


def policy_loss_from_callable(name: str, fn: Any) -> PolicyLoss:
    """A user's plain policy-loss function: keyword-only parameters outside :data:`POLICY_LOSS_CALL` are
    bound from ``algorithm.*`` by name; a ``generator`` parameter makes it seeded."""
    params = _parameters(fn)
    extra = tuple(
        p
        for p, spec in params.items()
        if p not in POLICY_LOSS_CALL and p != "generator" and spec.kind is inspect.Parameter.KEYWORD_ONLY
    )
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return PolicyLoss(name=name, target=fn, description=doc, config_params=extra, seeded="generator" in params)


def kl_from_callable(name: str, fn: Any) -> KLEstimator:
    """A user's plain KL function ``fn(logprob, ref_logprob) -> (B, T)``."""
    return KLEstimator(name=name, target=fn, description=(inspect.getdoc(fn) or "").split("\n")[0])


_ADV = "rlhf_ops.algorithms.advantages"
ADVANTAGE_ESTIMATORS: Table[AdvantageEstimator] = Table(
    what="advantage estimator",
    key="algorithm.adv_estimator",
    entry_type=AdvantageEstimator,
    group="rlhf_ops.advantage_estimators",
    from_callable=estimator_from_callable,
    entries=[
        AdvantageEstimator(
            name="gae",
            target=f"{_ADV}:compute_gae_advantage_return",
            description="PPO's GAE over critic values.",
            needs_critic=True,
            config_params=("gamma", "lam"),
        ),
        AdvantageEstimator(
            name="grpo",
            target=f"{_ADV}:compute_grpo_outcome_advantage",
            description="Score minus the group mean, over the group std (Dr.GRPO without the std).",
            group=True,
            config_params=("norm_adv_by_std_in_grpo",),
        ),
        AdvantageEstimator(
            name="rloo",
            target=f"{_ADV}:compute_rloo_outcome_advantage",
            description="Score minus the mean of the other samples of the group.",
            group=True,
        ),
        AdvantageEstimator(
            name="reinforce_plus_plus",
            target=f"{_ADV}:compute_reinforce_plus_plus_outcome_advantage",
            description="Discounted reward-to-go, whitened over the batch.",
            config_params=("gamma",),
        ),
        AdvantageEstimator(
            name="reinforce_plus_plus_baseline",
            target=f"{_ADV}:compute_reinforce_plus_plus_baseline_outcome_advantage",
            description="Group-mean baseline, whitened over the batch.",
            group=True,
        ),
        AdvantageEstimator(
            name="remax",
            target=f"{_ADV}:compute_remax_outcome_advantage",
            description="Reward-to-go minus the reward of the greedy response.",
            needs_greedy_baseline=True,
        ),
    ],
)

_LOSSES, _VARIANTS = "rlhf_ops.algorithms.losses", "rlhf_ops.algorithms.policy_losses"
POLICY_LOSSES: Table[PolicyLoss] = Table(
    what="policy loss",
    key="algorithm.policy_loss",
    entry_type=PolicyLoss,
    group="rlhf_ops.policy_losses",
    from_callable=policy_loss_from_callable,
    entries=[
        PolicyLoss(name="vanilla", target=f"{_LOSSES}:compute_policy_loss", description="Token-level PPO clip."),
        PolicyLoss(name="gspo", target=f"{_LOSSES}:compute_policy_loss_gspo", description="Sequence-level ratio."),
        PolicyLoss(
            name="clip_cov",
            target=f"{_VARIANTS}:compute_policy_loss_clip_cov",
            description="Clip-Cov: drops the loss of a few high-covariance tokens.",
            config_params=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
            seeded=True,
        ),
        PolicyLoss(
            name="kl_cov",
            target=f"{_VARIANTS}:compute_policy_loss_kl_cov",
            description="KL-Cov: a KL penalty on a few high-covariance tokens.",
            config_params=("kl_cov_ratio", "ppo_kl_coef"),
        ),
        PolicyLoss(
            name="cispo",
            target=f"{_VARIANTS}:compute_policy_loss_cispo",
            description="Clipped, detached importance weight times the log-prob.",
        ),
    ],
)

# Schulman's estimators; a trailing '+' keeps the value and takes k2's gradient (rlhf_ops.algorithms.kl).
_KL_BASE = {
    "kl": "log-ratio (k1)",
    "k1": "log-ratio",
    "abs": "absolute log-ratio",
    "mse": "half squared log-ratio (k2)",
    "k2": "half squared log-ratio",
    "low_var_kl": "exp(-d) + d - 1, clamped (k3)",
    "k3": "exp(-d) + d - 1, clamped",
}
# The built-ins share one function that reads the name (kl_penalty(logprob, ref_logprob, name)).
_KL_BUILTIN = "rlhf_ops.algorithms.kl:kl_penalty"
KL_ESTIMATORS: Table[KLEstimator] = Table(
    what="KL estimator",
    key="algorithm.kl_penalty",
    entry_type=KLEstimator,
    group="rlhf_ops.kl_estimators",
    from_callable=kl_from_callable,
    entries=[
        *(KLEstimator(name=n, target=_KL_BUILTIN, description=d) for n, d in _KL_BASE.items()),
        *(
            KLEstimator(name=f"{n}+", target=_KL_BUILTIN, description=f"{d}; k2's gradient")
            for n, d in _KL_BASE.items()
        ),
    ],
)
