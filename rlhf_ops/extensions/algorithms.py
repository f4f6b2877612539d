"""The algorithm tables: advantage estimators, policy losses and KL estimators.

Each entry states what the trainer and the validation ask of it. A built-in entry is declared by a decorator
on its function (:func:`advantage_estimator`, :func:`policy_loss`, :func:`kl_estimator`), in the module that
defines it; the table reads those decorators from the source, so the code itself is named by a
``"module:attribute"`` string and imported only when a step runs, and this module (and the config that reads
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from rlhf_ops.extensions.declared import Declaration, declare
from rlhf_ops.extensions.table import Entry, Table

F = TypeVar("F", bound=Callable[..., Any])

# How every policy loss (and the entropy and KL-loss terms) turns token losses into one scalar
# (rlhf_ops.algorithms.losses.agg_loss); the config field algorithm.loss_agg_mode takes the same values.
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

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
    """A KL estimator (``algorithm.kl_penalty`` in the reward, ``algorithm.kl_loss_type`` in the loss).

    Attributes:
        straight_through: The ``+`` form (``k3+``): this estimator's value with k2's gradient, the unbiased one.
    """

    straight_through: bool = False


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


def _one(entry_type: type[Any]) -> Callable[[Declaration], list[Any]]:
    """The entry of a declaration ``@decorator(name, **traits)``; the description defaults to the docstring."""

    def build(d: Declaration) -> list[Any]:
        traits = {k: v for k, v in d.kwargs.items() if k != "description"}
        description = d.kwargs.get("description") or d.doc
        return [entry_type(name=d.args[0], target=d.target, description=description, **traits)]

    return build


_advantage_entries = _one(AdvantageEstimator)
_policy_loss_entries = _one(PolicyLoss)


def _kl_entries(d: Declaration) -> list[KLEstimator]:
    """A KL declaration ``@kl_estimator(*names)``: each name, then each name's ``+`` form (k2's gradient)."""
    description = d.kwargs.get("description") or d.doc
    plain = [KLEstimator(name=n, target=d.target, description=description) for n in d.args]
    straight = [
        KLEstimator(name=f"{n}+", target=d.target, description=f"{description}; k2's gradient", straight_through=True)
        for n in d.args
    ]
    return [*plain, *straight]


ADVANTAGE_ESTIMATORS: Table[AdvantageEstimator] = Table(
    what="advantage estimator",
    key="algorithm.adv_estimator",
    entry_type=AdvantageEstimator,
    group="rlhf_ops.advantage_estimators",
    from_callable=estimator_from_callable,
    declared_in=("rlhf_ops.algorithms.advantages",),
    decorator="advantage_estimator",
    build=_advantage_entries,
)

POLICY_LOSSES: Table[PolicyLoss] = Table(
    what="policy loss",
    key="algorithm.policy_loss",
    entry_type=PolicyLoss,
    group="rlhf_ops.policy_losses",
    from_callable=policy_loss_from_callable,
    declared_in=("rlhf_ops.algorithms.policy_losses.ppo", "rlhf_ops.algorithms.policy_losses.*"),  # vanilla first
    decorator="policy_loss",
    build=_policy_loss_entries,
)

KL_ESTIMATORS: Table[KLEstimator] = Table(
    what="KL estimator",
    key="algorithm.kl_penalty",
    entry_type=KLEstimator,
    group="rlhf_ops.kl_estimators",
    from_callable=kl_from_callable,
    declared_in=("rlhf_ops.algorithms.kl",),
    decorator="kl_estimator",
    build=_kl_entries,
)


def advantage_estimator(
    name: str,
    *,
    description: str = "",
    group: bool = False,
    needs_critic: bool = False,
    needs_greedy_baseline: bool = False,
    config_params: tuple[str, ...] = (),
) -> Callable[[F], F]:
    """Declares the decorated function the advantage estimator ``name`` (:class:`AdvantageEstimator`'s traits).

    In ``rlhf_ops.algorithms.advantages`` it is a built-in (the table reads it from the source; literal
    arguments only); elsewhere it registers the entry when its module is imported.
    """
    traits = {"group": group, "needs_critic": needs_critic, "needs_greedy_baseline": needs_greedy_baseline}
    return declare(
        ADVANTAGE_ESTIMATORS, _advantage_entries, name, description=description, config_params=config_params, **traits
    )


def policy_loss(
    name: str, *, description: str = "", config_params: tuple[str, ...] = (), seeded: bool = False
) -> Callable[[F], F]:
    """Declares the decorated function the policy loss ``name`` (:class:`PolicyLoss`'s traits); built in
    under ``rlhf_ops.algorithms.policy_losses``."""
    return declare(
        POLICY_LOSSES, _policy_loss_entries, name, description=description, config_params=config_params, seeded=seeded
    )


def kl_estimator(*names: str, description: str = "") -> Callable[[F], F]:
    """Declares the decorated ``fn(logprob, ref_logprob) -> (B, T)`` the KL estimator ``names`` (aliases), each
    with its ``+`` form (this value, k2's gradient); built in in ``rlhf_ops.algorithms.kl``."""
    return declare(KL_ESTIMATORS, _kl_entries, *names, description=description)
