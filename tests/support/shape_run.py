"""The CPU "shape run" of a GPU preset: the same recipe, scaled to 2 CPU ranks and a small real model.

Test support: run by ``tests/integration/test_gpu_presets_shape_run.py`` (slow), checked by
``tests/unit/config/test_shape_run.py``.

A GPU preset cannot run on a CPU machine as written (8-16 GPUs, flash-attention, TP 2, thousands of tokens),
but most of what breaks a real run does not depend on scale: the reward function name, the data format, the
estimator and its needs (critic, reference, KL in the reward or as a loss), HSDP, activation checkpointing,
dynamic batch size and remove padding. :func:`shape_run_overrides` derives, from the preset itself, the
overrides that keep every one of those settings and change only what is tied to the hardware or to scale:

=========================  =====================================================================================
kept                       algorithm (all), reward, rollout.engine / n / temperature, actor / critic / ref
                           ``use_dynamic_bsz``, ``use_remove_padding``, activation checkpointing, offload flags,
                           ``hsdp_replicate_size`` (when it divides 2), lr schedule shape, the precision keys
changed (hardware)         ``resources`` -> 1 node x 2 CPU ranks; ``flash_attention_2`` -> ``sdpa``;
                           rollout TP -> 1, ``rollout.dtype`` -> float32 (vLLM on CPU runs fp32),
                           ``kv_cache_memory_bytes`` set (vLLM on CPU needs it); ``model.dtype`` -> float32 unless
                           ``keep_precision`` (this CPU has no native bf16: bf16 matmuls measured ~8x slower)
changed (scale)            ``model.path`` (e.g. SmolLM2-135M), data -> ``builtin:gsm8k_synth`` (the presets'
                           GSM8K format), 2 prompts per step, mini-batch = the step, token budgets = one
                           sequence, 16 new tokens, 2 steps, no validation, checkpoint only at the end, local
                           folder, no remote store, console logger
=========================  =====================================================================================

Because the overrides are computed from the loaded preset, a preset edit (a new algorithm key, another
reward) flows into its shape run; a preset setting the shape run cannot reproduce on CPU is an error here.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_ops.config.loader import load_config
from rlhf_ops.config.schema import RunConfig

__all__ = ["SHAPE_RUN_DATA", "shape_run_config", "shape_run_overrides"]

SHAPE_RUN_DATA = "builtin:gsm8k_synth"
NPROC = 2
PROMPTS_PER_STEP = 2
MAX_NEW_TOKENS = 16
MAX_PROMPT_LENGTH = 128  # gsm8k_synth prompts with the SmolLM2 chat template: at most 83 tokens (measured)
KV_CACHE_BYTES = 128 * 2**20  # SmolLM2: 30 layers x 2 x 3 KV heads x 64 x 4 B = 46 KB/token -> ~2,900 tokens


def _role_overrides(section: str, cfg: RunConfig, *, keep_precision: bool) -> list[str]:
    role = getattr(cfg, section)
    seqs_per_rank = PROMPTS_PER_STEP * cfg.rollout.n // NPROC
    out = [
        f"{section}.ppo_mini_batch_size={PROMPTS_PER_STEP}",
        f"{section}.ppo_micro_batch_size_per_gpu={max(1, seqs_per_rank)}",
        f"{section}.ppo_max_token_len_per_gpu={MAX_PROMPT_LENGTH + MAX_NEW_TOKENS}",
    ]
    if hasattr(role, "log_prob_max_token_len_per_gpu"):
        out.append(f"{section}.log_prob_max_token_len_per_gpu={MAX_PROMPT_LENGTH + MAX_NEW_TOKENS}")
    if not keep_precision and role.fsdp.mixed_precision.param_dtype is not None:
        out.append(f"{section}.fsdp.mixed_precision.param_dtype=null")
    if NPROC % role.fsdp.hsdp_replicate_size:
        out.append(f"{section}.fsdp.hsdp_replicate_size=1")
    if role.ulysses_sequence_parallel_size > NPROC:
        out.append(f"{section}.ulysses_sequence_parallel_size={NPROC}")
    return out


def shape_run_overrides(
    preset: str | Path, *, model_path: str, checkpoint_root: str, keep_precision: bool = False, steps: int = 2
) -> list[str]:
    """Dotted overrides that turn ``preset`` into its CPU shape run (see the module docstring).

    Args:
        preset: A GPU preset name or YAML path.
        model_path: Local HF causal-LM directory (the small real model).
        checkpoint_root: Local folder for the run's checkpoint and metrics.
        keep_precision: Keep the preset's ``model.dtype`` (bf16 compute = CPU autocast); off by default because
            bf16 matmuls are emulated (slow) on CPUs without AVX512-BF16 / AMX.
        steps: Training steps.

    Raises:
        ValueError: The preset uses something the CPU shape run cannot keep (an unknown reward is left to the
            run's pre-flight, which reports it).
    """
    cfg = load_config(preset)
    out = [
        f"model.path={model_path}",
        "model.tokenizer_path=null",
        f"data.train_files=[{SHAPE_RUN_DATA}]",
        "data.val_files=[]",
        f"data.max_prompt_length={MAX_PROMPT_LENGTH}",
        f"data.train_batch_size={PROMPTS_PER_STEP}",
        "data.val_batch_size=null",
        f"data.toy_rows={PROMPTS_PER_STEP * steps * 4}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        "rollout.tensor_model_parallel_size=1",
        "rollout.dtype=float32",
        f"rollout.kv_cache_memory_bytes={KV_CACHE_BYTES}",
        "rollout.enforce_eager=true",
        "resources.nnodes=1",
        f"resources.nproc_per_node={NPROC}",
        "resources.device=cpu",
        "resources.num_cpus_per_worker=0.5",
        "resources.ray_address=null",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1",
        "trainer.save_freq=0",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.keep_last=0",
        f"trainer.checkpoint_root={checkpoint_root}",
        "trainer.remote_store_url=null",
        "trainer.logger=[console,jsonl]",
        "tracking.mlflow_uri=null",
    ]
    if cfg.model.attn_implementation == "flash_attention_2":
        out.append("model.attn_implementation=sdpa")
    if not keep_precision:
        out.append("model.dtype=float32")
    out += _role_overrides("actor", cfg, keep_precision=keep_precision)
    if cfg.needs_critic:
        out += _role_overrides("critic", cfg, keep_precision=keep_precision)
        out.append("critic.model_path=null")
    if cfg.reward.model_path is not None:
        raise ValueError(
            f"{preset}: reward.model_path is set; the shape run has no small reward model for it. "
            "Fix: give the shape run a reward model directory or drop reward.model_path from the preset."
        )
    return out


def shape_run_config(
    preset: str | Path, *, model_path: str, checkpoint_root: str, keep_precision: bool = False, steps: int = 2
) -> RunConfig:
    """``preset`` with :func:`shape_run_overrides` applied (validated like any config)."""
    overrides = shape_run_overrides(
        preset, model_path=model_path, checkpoint_root=checkpoint_root, keep_precision=keep_precision, steps=steps
    )
    return load_config(preset, overrides)
