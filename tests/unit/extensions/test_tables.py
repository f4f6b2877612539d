"""The extension tables: built-in traits agree with the code, config values / schema / errors come from the
tables, and a user's entry registers by dotted path or by entry point."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.config.extension_rules import extension_problems
from rlhf_ops.config.schema import AlgorithmConfig, RunConfig
from rlhf_ops.extensions import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES
from rlhf_ops.extensions.algorithms import POLICY_LOSS_CALL, estimator_from_callable, policy_loss_from_callable
from rlhf_ops.extensions.rewards import REWARD_FUNCTIONS

_E = "tests.support.extension_entries"


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: f"{p.message}. Fix: {p.fix}" for p in info.value.problems}


@pytest.mark.parametrize("entry", list(ADVANTAGE_ESTIMATORS), ids=lambda e: e.name)
def test_builtin_estimator_traits_agree_with_the_signature(entry: object) -> None:
    from rlhf_ops.extensions.algorithms import AdvantageEstimator

    assert isinstance(entry, AdvantageEstimator)
    inferred = estimator_from_callable(entry.name, entry.load())
    assert (inferred.group, inferred.needs_critic, inferred.needs_greedy_baseline) == (
        entry.group,
        entry.needs_critic,
        entry.needs_greedy_baseline,
    )
    # Every config_params name is a parameter of the function and an algorithm.* field.
    params = inspect.signature(entry.load()).parameters
    assert all(p in params and p in AlgorithmConfig.model_fields for p in entry.config_params)
    # ...and every required parameter is either an input or a config_params name.
    assert set(inferred.config_params) <= set(entry.config_params)


@pytest.mark.parametrize("entry", list(POLICY_LOSSES), ids=lambda e: e.name)
def test_builtin_policy_loss_binds_exactly_its_own_keywords(entry: object) -> None:
    from rlhf_ops.extensions.algorithms import PolicyLoss

    assert isinstance(entry, PolicyLoss)
    inferred = policy_loss_from_callable(entry.name, entry.load())
    assert (sorted(inferred.config_params), inferred.seeded) == (sorted(entry.config_params), entry.seeded)
    assert set(POLICY_LOSS_CALL) >= {"old_log_prob", "log_prob", "advantages", "response_mask"}


def test_every_builtin_loads() -> None:
    for table in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, REWARD_FUNCTIONS):
        for entry in table:
            assert callable(entry.load()), (table.what, entry.name)
    for engine in ROLLOUT_ENGINES:  # the targets are strings naming workers/ code; each resolves
        assert engine.target.startswith("workers.rollout.")


def test_config_values_come_from_the_tables() -> None:
    problems = _problems(["algorithm.policy_loss=ppo2"])
    assert problems["algorithm.policy_loss"].startswith("is not a registered policy loss (got 'ppo2')")
    assert all(f"'{e.name}'" in problems["algorithm.policy_loss"] for e in POLICY_LOSSES)
    assert "'package.module:attribute'" in problems["algorithm.policy_loss"]
    assert "'k3+'" in _problems(["algorithm.kl_loss_type=k4"])["algorithm.kl_loss_type"]
    assert "'sglang'" in _problems(["rollout.engine=trt"])["rollout.engine"]


def test_schema_lists_the_selectable_names() -> None:
    schema = RunConfig.model_json_schema()
    algo, rollout = schema["$defs"]["AlgorithmConfig"]["properties"], schema["$defs"]["RolloutConfig"]["properties"]
    assert algo["adv_estimator"]["examples"] == ADVANTAGE_ESTIMATORS.names()
    assert algo["adv_estimator"]["x-extension-point"]["group"] == "rlhf_ops.advantage_estimators"
    assert "cispo" in algo["policy_loss"]["examples"] and "low_var_kl+" in algo["kl_loss_type"]["examples"]
    assert rollout["engine"]["examples"] == ["hf", "vllm", "sglang"]


def test_group_trait_of_a_user_estimator_is_checked() -> None:
    problems = _problems([f"algorithm.adv_estimator={_E}:centered_advantage", "rollout.n=1"])
    assert "normalises within the group" in problems["rollout.n"]
    run = load_config("tiny-cpu", [f"algorithm.adv_estimator={_E}:centered_advantage"])
    assert not run.needs_critic


def test_user_entry_with_a_wrong_signature_is_one_line() -> None:
    problems = _problems([f"algorithm.adv_estimator={_E}:missing_input_estimator"])
    assert list(problems) == ["algorithm.adv_estimator"]
    assert "['critic_values']" in problems["algorithm.adv_estimator"]


def test_user_entry_that_does_not_import_is_refused_at_preflight() -> None:
    # Not installed here: load_config leaves it to the pre-flight (the Airflow side may lack the package).
    run = load_config("tiny-cpu", ["algorithm.policy_loss=not_a_pkg_xyz.losses:mine"])
    problems = extension_problems(run, strict=True)
    assert [p.key for p in problems] == ["algorithm.policy_loss"]
    assert "cannot import module 'not_a_pkg_xyz.losses'" in problems[0].message
    missing_attr = _problems([f"algorithm.policy_loss={_E}:no_such_loss"])
    assert "has no attribute 'no_such_loss'" in missing_attr["algorithm.policy_loss"]


def test_engine_capabilities_are_checked() -> None:
    problems = _problems([f"rollout.engine={_E}:ENGINE", "rollout.mode=async"])
    assert problems["rollout.mode"].startswith("async rollout runs a vLLM AsyncLLM engine, but rollout.engine=")
    multi = _problems([f"rollout.engine={_E}:SYNC_ONLY_ENGINE", "rollout.multi_turn.enable=true"])
    assert "cannot run the agent loop" in multi["rollout.multi_turn.enable"]


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A distribution on sys.path whose entry points register an estimator and a reward (as pip would)."""
    info = tmp_path / "my_rl_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rl-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[rlhf_ops.advantage_estimators]\ncentered = {_E}:centered_advantage\n\n"
        f"[rlhf_ops.reward_functions]\nat_least_3 = {_E}:length_reward\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path


@pytest.mark.usefixtures("installed_plugin")
def test_entry_point_entries_are_selectable_and_listed() -> None:
    assert "centered" in ADVANTAGE_ESTIMATORS.names()
    run = load_config("tiny-cpu", ["algorithm.adv_estimator=centered", "reward.reward_fn=at_least_3"])
    entry = ADVANTAGE_ESTIMATORS.get(run.algorithm.adv_estimator)
    assert entry.group and entry.config_params == ("gamma",)
    from rlhf_ops.rewards import load_reward_fn

    assert load_reward_fn("at_least_3")("toy", "abcd", "", None) == 1.0
    schema = RunConfig.model_json_schema()
    assert "centered" in schema["$defs"]["AlgorithmConfig"]["properties"]["adv_estimator"]["examples"]


def test_cli_schema_lists_entry_points(installed_plugin: Path) -> None:
    env_path = f"{installed_plugin}:{Path.cwd()}"
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_ops.cli", "config", "schema"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "HOME": str(installed_plugin)},
    )
    prop = json.loads(out.stdout)["$defs"]["AlgorithmConfig"]["properties"]["adv_estimator"]
    assert prop["examples"][-1] == "centered"
