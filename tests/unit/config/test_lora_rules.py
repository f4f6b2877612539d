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


# --------------------------------------------------------------------------------------------- rollout.lora_sync
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "merged"),  # no LoRA: nothing to send but full weights
        (["model.lora.rank=8"], "merged"),  # tiny-cpu's engine is hf: no separate weights
        (["model.lora.rank=8", "rollout.engine=vllm", "rollout.kv_cache_memory_bytes=67108864"], "adapter"),
        (
            [
                "model.lora.rank=8",
                "rollout.engine=vllm",
                "rollout.kv_cache_memory_bytes=67108864",
                "rollout.mode=async",
            ],
            "merged",
        ),
        (
            [
                "model.lora.rank=8",
                "rollout.engine=vllm",
                "rollout.kv_cache_memory_bytes=67108864",
                "rollout.lora_sync=merged",
            ],
            "merged",
        ),
    ],
)
def test_auto_lora_sync_sends_the_adapter_where_the_engine_serves_it(overrides: list[str], expected: str) -> None:
    from rlhf_ops.config.lora_rules import resolve_lora_sync

    config = load_config("tiny-cpu", overrides)
    assert config.rollout.lora_sync == ("merged" if "rollout.lora_sync=merged" in overrides else "auto")
    assert resolve_lora_sync(config.model.lora, config.rollout, "cuda") == expected
    # On CPU, auto keeps the merged sync (vLLM's CPU LoRA kernels slow generation); adapter stays selectable.
    assert resolve_lora_sync(config.model.lora, config.rollout, "cpu") == "merged"
    explicit = config.rollout.model_copy(update={"lora_sync": "adapter"})
    assert resolve_lora_sync(config.model.lora, explicit, "cpu") == "adapter"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=67108864"], "model.lora.rank=0 trains every weight"),
        (["model.lora.rank=8"], "rollout.engine=hf holds no LoRA adapters"),
    ],
)
def test_adapter_sync_where_it_cannot_run_names_the_key_and_the_fix(overrides: list[str], reason: str) -> None:
    problems = _problems([*overrides, "rollout.lora_sync=adapter"])
    assert list(problems) == ["rollout.lora_sync"]
    line = problems["rollout.lora_sync"]
    assert "\n" not in line and reason in line
    assert "Fix: set rollout.lora_sync=auto (adapter where it can run, merged weights elsewhere) or merged" in line
