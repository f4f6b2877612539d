"""Pre-flight rules of ``trainer.pipeline`` and ``algorithm.rollout_correction`` (:mod:`rlhf_ops.config.off_policy`),
called by :mod:`rlhf_ops.config.validate`.
"""

from __future__ import annotations

from rlhf_ops.config.async_rules import async_problems
from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.extensions import ROLLOUT_ENGINES
from rlhf_ops.sampling import rollout_logprobs_comparable


def off_policy_problems(run: RunConfig) -> list[ConfigProblem]:
    """Cross-field problems of ``trainer.pipeline`` and ``algorithm.rollout_correction`` (empty when consistent)."""
    problems: list[ConfigProblem] = []
    algo, rollout = run.algorithm, run.rollout
    correction = algo.rollout_correction
    if correction.rollout_is is not None and algo.tis_imp_ratio_cap is not None:
        problems.append(
            ConfigProblem(
                "algorithm.rollout_correction.rollout_is",
                "set together with algorithm.tis_imp_ratio_cap (the same token-level correction under its older "
                "name): the loss would apply one of them",
                "keep one: rollout_correction.rollout_is=token with rollout_is_threshold=<cap>, or tis_imp_ratio_cap",
            )
        )
    if correction.rollout_is is not None and not rollout_logprobs_comparable(
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
    ):
        problems.append(
            ConfigProblem(
                "algorithm.rollout_correction.rollout_is",
                f"top_k / top_p truncate the sampled distribution (top_k={rollout.top_k}, top_p={rollout.top_p}) "
                f"at temperature {rollout.temperature}: the actor cannot recompute it, so the weight would measure "
                "the truncation",
                "sample with rollout.top_k=-1 and top_p=1.0 (any temperature), or at temperature 1.0, "
                "or set rollout_correction.rollout_is=null",
            )
        )
    if run.trainer.pipeline == "sync":
        return problems
    if run.trainer.pipeline == "async":  # its own rollout group: rlhf_ops.config.async_rules
        return problems + async_problems(run)
    engine = ROLLOUT_ENGINES.find(rollout.engine)  # an engine without an async mode: extension_rules says so
    if rollout.mode != "async" or engine is None or "async" not in engine.modes:
        problems.append(
            ConfigProblem(
                "trainer.pipeline",
                f"one_step_off generates the next batch in the async engine's own process while the ranks train, "
                f"but rollout.mode={rollout.mode}, rollout.engine={rollout.engine}",
                "set rollout.engine=vllm rollout.mode=async, or trainer.pipeline=sync",
            )
        )
    if algo.filter_groups.enable:
        problems.append(
            ConfigProblem(
                "trainer.pipeline",
                "one_step_off with algorithm.filter_groups.enable: dynamic sampling generates more rounds inside the "
                "step, with the current weights, so the step would not be one step off",
                "set trainer.pipeline=sync, or algorithm.filter_groups.enable=false",
            )
        )
    return problems
