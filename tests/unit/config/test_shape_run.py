"""The shape-run helper keeps each GPU preset's recipe and changes only hardware and scale (no Ray here)."""

from __future__ import annotations

import pytest

from rlhf_ops.config import derive_batch_plan, load_config
from rlhf_ops.rewards import load_reward_fn
from tests.support.shape_run import SHAPE_RUN_DATA, shape_run_config

PRESETS = ["qwen2.5-0.5b-grpo-gpu", "qwen2.5-7b-ppo-gpu"]


@pytest.mark.parametrize("preset", PRESETS)
def test_shape_run_keeps_the_recipe(preset: str, tmp_path) -> None:
    gpu = load_config(preset)
    cpu = shape_run_config(preset, model_path=str(tmp_path), checkpoint_root=str(tmp_path / "ckpt"))
    assert cpu.algorithm == gpu.algorithm  # estimator, KL placement, clip, loss aggregation: all kept
    assert cpu.reward == gpu.reward
    load_reward_fn(cpu.reward.reward_fn or "")  # the preset's reward exists (gsm8k)
    assert (cpu.rollout.engine, cpu.rollout.n, cpu.rollout.temperature) == (
        gpu.rollout.engine,
        gpu.rollout.n,
        gpu.rollout.temperature,
    )
    for role in ("actor", "critic") if gpu.needs_critic else ("actor",):
        g, c = getattr(gpu, role), getattr(cpu, role)
        assert (c.use_dynamic_bsz, c.use_remove_padding) == (g.use_dynamic_bsz, g.use_remove_padding)
        assert c.fsdp.activation_checkpointing == g.fsdp.activation_checkpointing
        assert c.fsdp.hsdp_replicate_size == g.fsdp.hsdp_replicate_size  # 1 or 2 both divide 2 ranks
        assert c.optim == g.optim
    assert cpu.ref.fsdp == gpu.ref.fsdp


@pytest.mark.parametrize("preset", PRESETS)
def test_shape_run_scales_hardware_and_batch(preset: str, tmp_path) -> None:
    cpu = shape_run_config(preset, model_path=str(tmp_path), checkpoint_root=str(tmp_path / "ckpt"))
    res = cpu.resources
    assert (res.device, res.nnodes, res.nproc_per_node, res.ray_address) == ("cpu", 1, 2, None)
    assert cpu.model.attn_implementation == "sdpa" and cpu.model.dtype == "float32"
    assert cpu.actor.fsdp.mixed_precision.param_dtype is None  # fp32 compute on CPU (no native bf16 here)
    assert (cpu.rollout.tensor_model_parallel_size, cpu.rollout.dtype) == (1, "float32")
    assert cpu.rollout.kv_cache_memory_bytes is not None
    assert cpu.data.train_files == [SHAPE_RUN_DATA] and cpu.data.train_batch_size == 2
    assert (cpu.trainer.total_training_steps, cpu.trainer.remote_store_url) == (2, None)
    plan = derive_batch_plan(cpu).actor
    # 2 prompts x n sequences in one mini-batch, split over 2 ranks (GRPO n=5: 5 each; PPO n=1: 1 each)
    assert plan.mini_batch_size_per_rank == cpu.rollout.n and plan.num_mini_batches == 1


def test_keep_precision_keeps_bf16_compute(tmp_path) -> None:
    cpu = shape_run_config(
        "qwen2.5-0.5b-grpo-gpu", model_path=str(tmp_path), checkpoint_root=str(tmp_path), keep_precision=True
    )
    assert cpu.model.dtype == "bfloat16"  # CPU autocast in the workers
