"""``trainer.pipeline`` and ``algorithm.rollout_correction``: defaults and every pre-flight rule (one line each)."""

from __future__ import annotations

import pytest

from rlhf_ops.config import load_config
from rlhf_ops.config.errors import ConfigError

ASYNC = ["rollout.engine=vllm", "rollout.mode=async", "rollout.kv_cache_memory_bytes=67108864"]


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_defaults_keep_the_sync_loop_and_no_correction() -> None:
    config = load_config("tiny-cpu", [])
    assert config.trainer.pipeline == "sync"
    assert config.algorithm.rollout_correction.rollout_is is None
    assert config.algorithm.rollout_correction.rollout_is_threshold == 2.0


def test_one_step_off_with_token_correction_on_the_async_engine_is_accepted() -> None:
    overrides = [*ASYNC, "trainer.pipeline=one_step_off", "algorithm.rollout_correction.rollout_is=token"]
    config = load_config("tiny-cpu", [*overrides, "algorithm.rollout_correction.rollout_is_threshold=3"])
    assert config.trainer.pipeline == "one_step_off"
    assert (
        config.algorithm.rollout_correction.rollout_is,
        config.algorithm.rollout_correction.rollout_is_threshold,
    ) == (
        "token",
        3.0,
    )


def test_one_step_off_needs_the_async_engine() -> None:
    problem = _problems(["trainer.pipeline=one_step_off"])["trainer.pipeline"]
    assert "rollout.mode=sync, rollout.engine=hf" in problem
    assert "set rollout.engine=vllm rollout.mode=async, or trainer.pipeline=sync" in problem


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["algorithm.adv_estimator=remax", "algorithm.use_kl_loss=false"], "ReMax's greedy baseline"),
        (["algorithm.filter_groups.enable=true"], "dynamic sampling generates more rounds"),
    ],
)
def test_one_step_off_refuses_a_second_rollout_inside_the_step(overrides: list[str], says: str) -> None:
    problem = _problems([*ASYNC, "trainer.pipeline=one_step_off", *overrides])["trainer.pipeline"]
    assert says in problem and "trainer.pipeline=sync" in problem


def test_rollout_correction_rules() -> None:
    both = _problems(["algorithm.rollout_correction.rollout_is=token", "algorithm.tis_imp_ratio_cap=2"])
    assert "keep one" in both["algorithm.rollout_correction.rollout_is"]
    # At temperature 0.7 without top-p / top-k the engines report log-probs at 0.7 (processed): allowed.
    allowed = load_config("tiny-cpu", ["algorithm.rollout_correction.rollout_is=sequence", "rollout.temperature=0.7"])
    assert allowed.algorithm.rollout_correction.rollout_is == "sequence"
    truncated = _problems(
        ["algorithm.rollout_correction.rollout_is=sequence", "rollout.temperature=0.7", "rollout.top_p=0.9"]
    )
    assert "top_p=1.0" in truncated["algorithm.rollout_correction.rollout_is"]
    bad = _problems(["algorithm.rollout_correction.rollout_is=geometric"])
    assert "algorithm.rollout_correction.rollout_is" in bad
    assert "algorithm.rollout_correction.rollout_is_threshold" in _problems(
        ["algorithm.rollout_correction.rollout_is_threshold=0"]
    )
    assert "trainer.pipeline" in _problems(["trainer.pipeline=two_steps_off"])
