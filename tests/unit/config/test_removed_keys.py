"""Keys that did nothing are gone or refused: setting one gives one line naming it and the fix."""

from __future__ import annotations

import pytest

from rlhf_ops.config import ConfigError, load_config


def test_a_removed_key_is_an_unknown_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", ["trainer.log_every=5"])
    (line,) = [str(p) for p in err.value.problems]
    assert line.startswith("trainer.log_every: Extra inputs are not permitted") and "remove it" in line


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("optimizer_offload", "true"),
        ("activation_checkpointing", "true"),
        ("hsdp_replicate_size", "2"),
        ("fsdp_size", "1"),
    ],
)
def test_a_reference_fsdp_key_without_effect_is_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [f"ref.fsdp.{key}={value}"])
    (line,) = [str(p) for p in err.value.problems]
    assert line.startswith(f"ref.fsdp.{key}: has no effect") and line.endswith(f"Fix: remove ref.fsdp.{key}")


@pytest.mark.parametrize("key", ["optimizer_offload", "activation_checkpointing"])
def test_a_reward_model_fsdp_key_without_effect_is_refused(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [f"reward.fsdp.{key}=true"])
    (line,) = [str(p) for p in err.value.problems]
    assert line.startswith(f"reward.fsdp.{key}: has no effect: the reward model")
    assert line.endswith(f"Fix: remove reward.fsdp.{key}")


def test_the_same_keys_still_work_for_the_actor() -> None:
    run = load_config("tiny-cpu", ["actor.fsdp.activation_checkpointing=true", "actor.fsdp.optimizer_offload=true"])
    assert run.actor.fsdp.activation_checkpointing and run.actor.fsdp.optimizer_offload
