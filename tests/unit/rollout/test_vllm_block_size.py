"""``rollout.kv_block_size``: the vLLM KV block that decides whether the n samples of a prompt share its prefill.

vLLM's CPU attention takes blocks in multiples of 32 and defaults to 128; a prompt shorter than a block is
prefilled once per sample. The platform's CPU default is 32; pre-flight names the key when a CPU run asks for a
size the CPU attention refuses (vLLM's own error comes only after the engine has loaded the model).
"""

from __future__ import annotations

import pytest

from rlhf_ops.config.errors import ConfigError
from rlhf_ops.config.loader import load_config
from rlhf_ops.config.schema import RolloutConfig
from rlhf_ops.config.section import CPU_KV_BLOCK_SIZE
from workers.rollout.vllm_rollout import kv_block_size

VLLM = ["rollout.engine=vllm", "rollout.kv_cache_memory_bytes=268435456"]


def test_cpu_default_is_the_smallest_block_the_cpu_attention_takes() -> None:
    assert CPU_KV_BLOCK_SIZE == 32
    assert kv_block_size(RolloutConfig(), "cpu") == 32
    assert kv_block_size(RolloutConfig(), "cuda") is None  # vLLM picks per attention backend on GPU
    assert kv_block_size(RolloutConfig(kv_block_size=64), "cpu") == 64
    assert kv_block_size(RolloutConfig(kv_block_size=16), "cuda") == 16


def test_a_cpu_run_with_a_block_the_cpu_attention_refuses_fails_at_pre_flight() -> None:
    assert load_config("tiny-cpu", [*VLLM, "rollout.kv_block_size=64"]).rollout.kv_block_size == 64
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [*VLLM, "rollout.kv_block_size=48"])
    (problem,) = info.value.problems
    assert problem.key == "rollout.kv_block_size"
    assert "multiples of 32" in problem.message and problem.fix == "set 32 (or leave it unset)"


@pytest.mark.parametrize("value", ["0", "20", "-32"])
def test_a_block_size_that_is_no_multiple_of_16_is_refused_by_the_schema(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", [*VLLM, f"rollout.kv_block_size={value}"])
    assert [p.key for p in info.value.problems] == ["rollout.kv_block_size"]
