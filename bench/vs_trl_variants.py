"""The platform's variants of ``bench/bench_vs_trl.py``: config overrides per name, and the ones ``--variants auto``
runs on each host kind (the CPU flags decide: AMX, AVX512-BF16, or bf16 emulated)."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["AUTO_VARIANTS", "RANK_VARIANTS", "host_kind", "variant_names"]

# 2 ranks x 1 thread: 16 of the 32 sequences per rank. "1x2-unshared" is the same as 1x2 without shared
# prompts (the configuration before actor.share_prompt_prefix), for the lever's own ratio and reward curve.
RANK_VARIANTS = {
    "1x2": [],
    "2x1": ["resources.nproc_per_node=2", "resources.num_cpus_per_worker=1"],
    "1x2-unshared": [
        "actor.share_prompt_prefix=false",
        "actor.ppo_micro_batch_size_per_gpu=32",
        "actor.log_prob_micro_batch_size_per_gpu=32",
        "ref.log_prob_micro_batch_size_per_gpu=32",
    ],
    # 1x2 with bf16 matmuls (torch.autocast on CPU; fp32 master weights, optimizer, log-softmax and losses):
    # worth it only where the CPU has AVX512-BF16 / AMX (the bench's matmul peak line says).
    "1x2-bf16": [
        "actor.fsdp.mixed_precision.param_dtype=bfloat16",
        "ref.fsdp.mixed_precision.param_dtype=bfloat16",
    ],
    # 1x2-bf16 with the gradients reduce-scattered once per mini-batch instead of after each micro-batch.
    "1x2-bf16-gs1": [
        "actor.fsdp.mixed_precision.param_dtype=bfloat16",
        "ref.fsdp.mixed_precision.param_dtype=bfloat16",
        "actor.fsdp.grad_sync_last_micro_batch=true",
    ],
    # 1x2-bf16 with plain parameters on the one rank: no FSDP2 all-gather / reduce-scatter copies.
    "1x2-bf16-plain": [
        "actor.fsdp.mixed_precision.param_dtype=bfloat16",
        "ref.fsdp.mixed_precision.param_dtype=bfloat16",
        "actor.fsdp.single_rank_plain=true",
        "ref.fsdp.single_rank_plain=true",
    ],
    "1x2-plain": ["actor.fsdp.single_rank_plain=true", "ref.fsdp.single_rank_plain=true"],
}
# 1x2-plain with vLLM's CPU KV block of 128 (the setting before rollout.kv_block_size defaulted to 32 on CPU): the
# 47-token prompts fill no block, so each of the 4 samples prefills its prompt again. For the lever's own ratio.
RANK_VARIANTS["1x2-plain-kv128"] = [*RANK_VARIANTS["1x2-plain"], "rollout.kv_block_size=128"]
# 1x2-plain with micro-batches of 16 (two groups per GEMM): larger products, fewer tied-embedding gradients.
RANK_VARIANTS["1x2-plain-mb16"] = [
    *RANK_VARIANTS["1x2-plain"],
    "actor.ppo_micro_batch_size_per_gpu=16",
    "actor.log_prob_micro_batch_size_per_gpu=16",
    "ref.log_prob_micro_batch_size_per_gpu=16",
]
# 1x2-plain with the shared-prompt row attended per prompt group (actor.share_prompt_attention=per_prompt): sum of
# n_g^2 attention scores instead of N^2, so a micro-batch of all 8 groups no longer pays a dense 8-group mask.
RANK_VARIANTS["1x2-plain-pp"] = [*RANK_VARIANTS["1x2-plain"], "actor.share_prompt_attention=per_prompt"]
RANK_VARIANTS["1x2-plain-pp32"] = [
    *RANK_VARIANTS["1x2-plain-pp"],
    "actor.ppo_micro_batch_size_per_gpu=32",
    "actor.log_prob_micro_batch_size_per_gpu=32",
    "ref.log_prob_micro_batch_size_per_gpu=32",
]
# 1x2-bf16-plain with the vLLM engine in bf16 too (the rollout's GEMMs on the bf16 units; the update stays
# on-policy: its ratio uses the actor's own log-probs, the engine's only feed the rollout-vs-actor metrics).
RANK_VARIANTS["1x2-bf16-full"] = [*RANK_VARIANTS["1x2-bf16-plain"], "rollout.dtype=bfloat16"]
# ... with micro-batches of 16 (two 8-sample groups per GEMM): AMX reaches more of its peak on ~450-token
# products than on ~230 (measured on an AMX Xeon; they lost on the AVX512-BF16 EPYC).
RANK_VARIANTS["1x2-bf16-full-mb16"] = [
    *RANK_VARIANTS["1x2-bf16-full"],
    "actor.ppo_micro_batch_size_per_gpu=16",
    "actor.log_prob_micro_batch_size_per_gpu=16",
    "ref.log_prob_micro_batch_size_per_gpu=16",
]


def host_kind() -> str:
    """``amx``, ``avx512_bf16`` or ``fp32`` (bf16 emulated): the CPU flags that decide the bench's variants."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "fp32"


# ``--variants auto``: the fp32 baseline and the settings measured fastest on each host kind.
AUTO_VARIANTS = {
    "amx": ["1x2-plain", "1x2-bf16-plain", "1x2-bf16-full-mb16"],
    "avx512_bf16": ["1x2-plain", "1x2-bf16-plain", "1x2-bf16-full"],
    "fp32": ["1x2-plain", "1x2-plain-pp32"],
}


def variant_names(spec: str) -> list[str]:
    """``--variants``: the names, or for ``auto`` the fastest settings measured on 2 cores (bf16 only where native)."""
    if spec != "auto":
        names = spec.split(",")
        unknown = [n for n in names if n not in RANK_VARIANTS]
        if unknown:
            sys.exit(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(RANK_VARIANTS)} or auto")
        return names
    from workers.fsdp.precision import cpu_has_native_bf16

    return AUTO_VARIANTS[host_kind()] if cpu_has_native_bf16() else AUTO_VARIANTS["fp32"]
