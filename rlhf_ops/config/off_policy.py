"""Off-policy rollouts: ``trainer.pipeline`` (one-step off-policy pipelining) and
``algorithm.rollout_correction`` (verl's rollout importance sampling).

Its own module so the schema stays readable; :class:`~rlhf_ops.config.schema.AlgorithmConfig` holds
:class:`RolloutCorrectionConfig`. Cross-field rules: :mod:`rlhf_ops.config.off_policy_rules` (it reads the
schema, which imports this module). Design: ``docs/async_rollout.md`` ("One-step off-policy pipelining").
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_ops.config.section import Section

Pipeline = Literal["sync", "one_step_off", "async"]


class RolloutCorrectionConfig(Section):
    """verl's ``algorithm.rollout_correction`` (decoupled mode): importance weights between the policy that
    sampled the rollout (its engine's log-probs) and the actor's ``old_log_probs``, truncated at a cap.

    Off by default. It corrects what the PPO ratio does not see: the engine's numerics (vLLM kernels, bf16)
    and, with ``trainer.pipeline=one_step_off``, the one update the rollout lags behind the actor.
    """

    rollout_is: Literal["token", "sequence"] | None = Field(
        None,
        description="Importance-weight level: 'token' (min(pi_old / pi_rollout, cap) per token: truncated IS), "
        "'sequence' (the product over the response's model tokens, capped, on every token of the row), or "
        "None (off).",
    )
    rollout_is_threshold: float = Field(
        2.0, gt=0.0, description="Cap of the weight (verl's default 2; token 1.5-5, sequence 2-10 are typical)."
    )
