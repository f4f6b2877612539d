"""The rules that read the extension tables: what the selected entries need from the rest of the config.

A rule reads an entry's traits (a group estimator needs ``rollout.n >= 2``; async rollout needs an engine with
an async mode), never its name. At config load a user's entry (dotted path, entry point) is checked when it
imports here, and skipped when its package is not installed here (the Airflow side may validate a config
whose code only the Ray job has); the pre-flight passes ``strict=True``, so an entry that does not import,
has the wrong signature or contradicts the config is one line before anything starts.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

from rlhf_ops.code_policy import split_dotted
from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import AlgorithmConfig, RunConfig
from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES, Table
from rlhf_ops.extensions.algorithms import ADVANTAGE_INPUTS, AdvantageEstimator, PolicyLoss
from rlhf_ops.extensions.rollout import RolloutEngineSpec

# Estimators that normalise within the group of samples of one prompt (need n >= 2): the built-ins' traits.
GROUP_ESTIMATORS = frozenset(entry.name for entry in ADVANTAGE_ESTIMATORS if entry.group)


def _installed_here(value: str) -> bool:
    """Whether a user entry's top-level package can be found here (without importing it)."""
    module, _ = split_dotted(value)
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _resolve(table: Table[Any], key: str, value: str, strict: bool, problems: list[ConfigProblem]) -> Any:
    """The entry of ``value``; None (and, when it should resolve here, a problem) when it does not."""
    known = table.known(value)
    if known is not None:
        return known
    if not strict and ":" in value and not _installed_here(value):
        return None
    try:
        return table.get(value, key=key)
    except ValueError as err:
        message = str(err).removeprefix(f"{key}: ")
    except Exception as err:  # user code: anything can happen at import time
        message = f"importing {value!r} raised {type(err).__name__}: {err}"
    builtins = ", ".join(table.builtin_names())
    problems.append(ConfigProblem(key, message.rstrip("."), f"fix {key} (a built-in: {builtins})"))
    return None


def _signature_problem(key: str, fn: Any, allowed: set[str]) -> str | None:
    """A required parameter of ``fn`` that nothing passes (None when every required one is provided)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    missing = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and p.name not in allowed
    ]
    if not missing:
        return None
    return f"{key}: takes {missing}, which the trainer does not pass (it passes {sorted(allowed)})"


def _estimator_problems(run: RunConfig, entry: AdvantageEstimator, problems: list[ConfigProblem]) -> None:
    if entry.group and run.rollout.n < 2:
        problems.append(
            ConfigProblem(
                "rollout.n",
                f"{run.rollout.n} sample(s) per prompt, but algorithm.adv_estimator={entry.name} "
                "normalises within the group of samples of a prompt",
                "set rollout.n >= 2 (4-16 is typical)",
            )
        )
    fields = set(AlgorithmConfig.model_fields)
    unknown = [p for p in entry.config_params if p not in fields]
    if unknown:
        problems.append(
            ConfigProblem(
                "algorithm.adv_estimator",
                f"{entry.name!r} takes {unknown}, which are neither its inputs {list(ADVANTAGE_INPUTS)} nor "
                "algorithm.* fields",
                "give those parameters defaults, or rename them to the inputs the trainer passes",
            )
        )
    if entry.needs_greedy_baseline and run.trainer.pipeline != "sync":
        problems.append(
            ConfigProblem(
                "trainer.pipeline",
                f"one_step_off with adv_estimator={entry.name}: ReMax's greedy baseline is a second rollout of the "
                "same prompts with the current weights, which the prefetch cannot provide",
                "set trainer.pipeline=sync, or another estimator (grpo, rloo, reinforce_plus_plus_baseline)",
            )
        )


def _policy_loss_problems(entry: PolicyLoss, problems: list[ConfigProblem]) -> None:
    unknown = [p for p in entry.config_params if p not in AlgorithmConfig.model_fields]
    if unknown:
        problems.append(
            ConfigProblem(
                "algorithm.policy_loss",
                f"{entry.name!r} takes keyword-only {unknown}, which are no algorithm.* fields",
                "give them defaults, or name them after algorithm.* fields",
            )
        )


def _engine_problems(run: RunConfig, engine: RolloutEngineSpec, problems: list[ConfigProblem]) -> None:
    rollout, device = run.rollout, run.resources.device
    if rollout.mode not in engine.modes:
        # The fix suggests the engines that have run (an untried one is still selectable, never suggested).
        capable = [e for e in ROLLOUT_ENGINES if "async" in e.modes and device in e.devices and not e.not_run_here]
        runs = " or ".join(e.async_description for e in capable) or "an engine with an async mode"
        problems.append(
            ConfigProblem(
                "rollout.mode",
                f"async rollout runs {runs}, but rollout.engine={engine.name}",
                f"set rollout.engine={' or '.join(e.name for e in capable)}, or rollout.mode=sync",
            )
        )
    if device not in engine.devices:
        problems.append(
            ConfigProblem(
                "rollout.engine",
                f"{engine.name} runs on {sorted(engine.devices)}, not resources.device={device}",
                "set rollout.engine=" + " or ".join(e.name for e in ROLLOUT_ENGINES if device in e.devices),
            )
        )
    if device == "cpu" and engine.cpu_kv_cache_bytes and rollout.kv_cache_memory_bytes is None:
        problems.append(
            ConfigProblem(
                "rollout.kv_cache_memory_bytes",
                f"{engine.name} on CPU needs an explicit, small KV cache size",
                "set e.g. rollout.kv_cache_memory_bytes=268435456",
            )
        )
    if rollout.multi_turn.enable and not engine.multi_turn:
        problems.append(
            ConfigProblem(
                "rollout.multi_turn.enable",
                f"rollout.engine={engine.name} cannot run the agent loop",
                "set rollout.multi_turn.enable=false, or an engine that can (hf, vllm)",
            )
        )


def extension_problems(run: RunConfig, *, strict: bool = False) -> list[ConfigProblem]:
    """Every problem between the selected extension entries and the rest of ``run`` (empty when consistent).

    Args:
        run: The config.
        strict: Resolve every user entry (the pre-flight); False skips one whose package is not installed here.
    """
    problems: list[ConfigProblem] = []
    algo = run.algorithm
    estimator = _resolve(ADVANTAGE_ESTIMATORS, "algorithm.adv_estimator", algo.adv_estimator, strict, problems)
    if estimator is not None:
        _estimator_problems(run, estimator, problems)
        if ADVANTAGE_ESTIMATORS.known(estimator.name) is None:  # a user's: its signature against its traits
            allowed = {"token_level_rewards", "response_mask", *estimator.config_params}
            allowed |= {"index"} if estimator.group else set()
            allowed |= {"values"} if estimator.needs_critic else set()
            allowed |= {"reward_baselines"} if estimator.needs_greedy_baseline else set()
            line = _signature_problem("algorithm.adv_estimator", estimator.load(), allowed)
            if line:
                problems.append(ConfigProblem("algorithm.adv_estimator", line.split(": ", 1)[1], "fix its signature"))
    loss = _resolve(POLICY_LOSSES, "algorithm.policy_loss", algo.policy_loss, strict, problems)
    if loss is not None:
        _policy_loss_problems(loss, problems)
    if algo.use_kl_in_reward:
        _resolve(KL_ESTIMATORS, "algorithm.kl_penalty", algo.kl_penalty, strict, problems)
    if algo.use_kl_loss:
        _resolve(KL_ESTIMATORS, "algorithm.kl_loss_type", algo.kl_loss_type, strict, problems)
    engine = _resolve(ROLLOUT_ENGINES, "rollout.engine", run.rollout.engine, strict, problems)
    if engine is not None:
        _engine_problems(run, engine, problems)
    return problems


def engine_package_problems(run: RunConfig) -> list[ConfigProblem]:
    """The engine's Python package does not import here: the training job's pre-flight (where the workers
    run) refuses the run with the reason, before Ray or any worker starts. Not part of the shared pre-flight:
    the Airflow side has no inference engine installed."""
    engine = ROLLOUT_ENGINES.find(run.rollout.engine)
    missing = None if engine is None else engine.missing_package()
    if engine is None or missing is None:
        return []
    return [
        ConfigProblem(
            "rollout.engine", missing, f"install {engine.package} on the workers' image, or set rollout.engine=hf"
        )
    ]
