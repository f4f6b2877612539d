"""One table per extension point (advantage estimators, policy losses, KL estimators, reward functions,
rollout engines): the config's allowed values, the validation and the dispatch all read them.

Torch-free: an entry names its code by a ``"module:attribute"`` string, imported when a run uses it.
``docs/where_to_change_what.md`` has the recipes.
"""

from __future__ import annotations

from rlhf_ops.extensions.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    KLEstimator,
    PolicyLoss,
)
from rlhf_ops.extensions.rollout import ROLLOUT_ENGINES, RolloutEngine, RolloutEngineSpec
from rlhf_ops.extensions.table import Entry, Table, choice_check, choice_schema, is_dotted

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "ROLLOUT_ENGINES",
    "AdvantageEstimator",
    "Entry",
    "KLEstimator",
    "PolicyLoss",
    "RolloutEngine",
    "RolloutEngineSpec",
    "Table",
    "choice_check",
    "choice_schema",
    "is_dotted",
]
