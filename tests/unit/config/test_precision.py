"""Precision resolution (rlhf_ops.config.precision): master / compute / reduce dtypes and the mechanism."""

from __future__ import annotations

import logging

import pytest

from rlhf_ops.config import load_config
from rlhf_ops.config.precision import RolePrecision, resolve_precision
from rlhf_ops.config.schema import FSDPConfig, MixedPrecisionConfig


def test_trained_role_keeps_fp32_master_weights_whatever_the_compute_dtype() -> None:
    gpu = resolve_precision("bfloat16", FSDPConfig(), trained=True, device="cuda")
    cpu = resolve_precision("bfloat16", FSDPConfig(), trained=True, device="cpu")
    assert gpu == RolePrecision(master="float32", compute="bfloat16", reduce="float32", mechanism="fsdp2")
    assert cpu == RolePrecision(master="float32", compute="bfloat16", reduce="float32", mechanism="autocast")


def test_fp32_run_needs_no_mechanism() -> None:
    p = resolve_precision("float32", FSDPConfig(), trained=True, device="cpu")
    assert (p.master, p.compute, p.mechanism) == ("float32", "float32", "none")


def test_reference_is_stored_in_bf16_on_gpu_and_fp32_under_cpu_autocast() -> None:
    gpu = resolve_precision("bfloat16", FSDPConfig(), trained=False, device="cuda", role="ref")
    cpu = resolve_precision("bfloat16", FSDPConfig(), trained=False, device="cpu", role="ref")
    assert (gpu.master, gpu.compute, gpu.mechanism) == ("bfloat16", "bfloat16", "none")
    assert (cpu.master, cpu.compute, cpu.mechanism) == ("float32", "bfloat16", "autocast")


def test_role_param_dtype_overrides_model_dtype() -> None:
    fsdp = FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="bfloat16"))
    p = resolve_precision("float32", fsdp, trained=True, device="cuda")
    assert p == RolePrecision(master="float32", compute="bfloat16", reduce="bfloat16", mechanism="fsdp2")


def test_forced_bf16_master_on_a_trained_role_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rlhf_ops.config.precision"):
        p = resolve_precision("bfloat16", FSDPConfig(master_dtype="bfloat16"), trained=True, device="cuda")
    assert (p.master, p.mechanism) == ("bfloat16", "none")
    assert "actor.fsdp.master_dtype=bfloat16" in caplog.text and "round to zero" in caplog.text


def test_bf16_master_with_fp32_compute_on_cpu_is_a_cast_not_autocast() -> None:
    # autocast only lowers precision; bf16 shards gathered as fp32 is FSDP2's cast on either device
    p = resolve_precision("float32", FSDPConfig(master_dtype="bfloat16"), trained=False, device="cpu")
    assert p.mechanism == "fsdp2"


def test_no_warning_for_the_defaults(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        resolve_precision("bfloat16", FSDPConfig(), trained=True, device="cuda")
        resolve_precision("bfloat16", FSDPConfig(), trained=False, device="cuda", role="ref")
    assert caplog.text == ""


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b-grpo-gpu", "qwen2.5-7b-ppo-gpu"])
def test_gpu_presets_train_fp32_masters_with_bf16_compute(preset: str) -> None:
    cfg = load_config(preset, [])
    actor = resolve_precision(cfg.model.dtype, cfg.actor.fsdp, trained=True, device=cfg.resources.device)
    ref = resolve_precision(cfg.model.dtype, cfg.ref.fsdp, trained=False, device=cfg.resources.device, role="ref")
    assert (actor.master, actor.compute, actor.reduce, actor.mechanism) == ("float32", "bfloat16", "float32", "fsdp2")
    assert (ref.master, ref.compute) == ("bfloat16", "bfloat16")
    if cfg.needs_critic:
        critic = resolve_precision(cfg.model.dtype, cfg.critic.fsdp, trained=True, device="cuda", role="critic")
        assert (critic.master, critic.compute) == ("float32", "bfloat16")


def test_master_dtype_is_a_config_key() -> None:
    cfg = load_config("tiny-cpu", ["actor.fsdp.master_dtype=bfloat16"])
    assert cfg.actor.fsdp.master_dtype == "bfloat16"
    assert cfg.ref.fsdp.master_dtype is None


def _problems(overrides: list[str]) -> dict[str, str]:
    from rlhf_ops.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    return {p.key: f"{p.message}. Fix: {p.fix}" for p in info.value.problems}


def test_gpu_share_on_cpu_is_refused() -> None:
    problems = _problems(["resources.gpus_per_worker=0.5"])
    assert "set resources.device=cuda" in problems["resources.gpus_per_worker"]


def test_gpu_share_with_tensor_parallel_rollout_is_refused() -> None:
    problems = _problems(
        ["resources.device=cuda", "resources.gpus_per_worker=0.5", "rollout.tensor_model_parallel_size=2"]
    )
    assert "NCCL refuses two ranks on one device" in problems["rollout.tensor_model_parallel_size"]
    assert "resources.gpus_per_worker" not in problems  # device=cuda: the share itself is fine


def test_two_ranks_sharing_one_gpu_validate() -> None:
    cfg = load_config("tiny-cpu", ["resources.device=cuda", "resources.gpus_per_worker=0.5"])
    assert cfg.resources.gpus_per_worker == 0.5
