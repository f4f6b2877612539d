"""``trainer.pipeline=async`` pre-flight (``rlhf_ops.config.async_rules``): each bad setting is one problem naming
its key and the fix; verl's ``async_training.*`` keys map or are refused."""

from __future__ import annotations

import pytest

from rlhf_ops.config import load_config
from rlhf_ops.config.errors import ConfigError

ASYNC = ["trainer.pipeline=async"]


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [*ASYNC, *overrides])
    return {p.key: str(p) for p in info.value.problems}


def test_async_defaults_are_accepted() -> None:
    config = load_config("tiny-cpu", ASYNC)
    a = config.trainer.async_rollout
    assert (a.max_staleness, a.depth, a.stale_policy, a.partial_rollout) == (1, 2, "drop", True)
    assert load_config("tiny-cpu", [*ASYNC, "trainer.async_rollout.buffer_batches=4"]).trainer.async_rollout.depth == 4


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["trainer.async_rollout.max_staleness=-1"], "trainer.async_rollout.max_staleness", "set 0 (on-policy)"),
        (["trainer.async_rollout.buffer_batches=0"], "trainer.async_rollout.buffer_batches", "set 1 or more"),
        (["trainer.async_rollout.num_workers=0"], "trainer.async_rollout.num_workers", "set 1 or more"),
        (["trainer.async_rollout.stale_policy=correct"], "trainer.async_rollout.stale_policy", "rollout_is=token"),
        (["rollout.mode=async"], "rollout.mode", "set rollout.mode=sync"),
        (["model.lora.rank=8"], "model.lora.rank", "model.lora.rank=0"),
        (["trainer.async_rollout.weight_transport=remote_store"], "trainer.async_rollout.weight_transport", "URL"),
        (["trainer.async_rollout.num_workers=17"], "trainer.async_rollout.num_workers", "num_workers <= 16"),
    ],
)
def test_bad_async_settings_are_one_line_with_the_fix(overrides: list[str], key: str, says: str) -> None:
    problems = _problems(overrides)
    assert key in problems, problems
    assert says in problems[key] and "\n" not in problems[key]


def test_the_rollout_group_takes_the_vllm_engine() -> None:
    config = load_config("tiny-cpu", [*ASYNC, "rollout.engine=vllm", "rollout.kv_cache_memory_bytes=1048576"])
    assert (config.trainer.pipeline, config.rollout.engine) == ("async", "vllm")


def test_correct_with_rollout_correction_is_accepted() -> None:
    overrides = [*ASYNC, "trainer.async_rollout.stale_policy=correct", "algorithm.rollout_correction.rollout_is=token"]
    assert load_config("tiny-cpu", overrides).trainer.async_rollout.stale_policy == "correct"


def test_verl_partial_rollout_key_is_carried() -> None:
    config = load_config("tiny-cpu", [*ASYNC, "async_training.partial_rollout=false"])
    assert config.trainer.async_rollout.partial_rollout is False
