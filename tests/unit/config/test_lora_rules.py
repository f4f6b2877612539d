"""Error path of ``model.lora.save_adapter_only`` (one line: key, fix), and verl's key for it."""

from __future__ import annotations

import pytest

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.config.verl_compat import translate


def _problems(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: str(p) for p in info.value.problems}


def test_adapter_only_keys_default_off_and_are_accepted_with_lora() -> None:
    assert load_config("tiny-cpu").model.lora.save_adapter_only is False
    lora = load_config("tiny-cpu", ["model.lora.rank=8", "model.lora.save_adapter_only=true"]).model.lora
    assert (lora.rank, lora.save_adapter_only) == (8, True)


def test_adapter_only_without_lora_names_the_key_and_the_fix() -> None:
    problems = _problems(["model.lora.save_adapter_only=true"])
    assert list(problems) == ["model.lora.save_adapter_only"]
    line = problems["model.lora.save_adapter_only"]
    assert "\n" not in line and "model.lora.rank=0" in line
    assert "Fix: set model.lora.rank > 0 (e.g. 8), or model.lora.save_adapter_only=false" in line


def test_verl_save_lora_only_carries_to_the_native_key() -> None:
    out = translate([("actor_rollout_ref.actor.checkpoint.save_lora_only", True)])
    assert not out.problems
    assert ("model.lora.save_adapter_only", True) in out.pairs
