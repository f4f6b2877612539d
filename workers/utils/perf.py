"""Model FLOPs utilisation from the architecture, the device's peak, and per-stage memory metrics of one rank.

FLOPs (matmul FLOPs only, 2 per multiply-add; norms, softmax and activations are ignored as usual):

- Weights: every ``nn.Linear`` processes each token once, so a forward costs ``2 * in * out`` per token per
  linear. Embedding lookups cost nothing (a tied LM head is counted once, as the head's matmul, whatever the
  parameter count says). GQA is exact because k / v projections are counted by their real shapes. LoRA's
  adapters are linears too (``2 * r * (in + out)`` per token).
- Backward: a trained weight costs 4 per multiply-add (input gradient + weight gradient), a frozen one 2
  (input gradient only): with LoRA the frozen base costs 4x its forward FLOPs in total instead of 6x.
- Attention scores: ``Q K^T`` and ``A V`` cost ``2 * 2 * heads * head_dim`` per (query, key) pair and layer,
  over the causal pairs of each sequence's real (unpadded) length s: ``s (s + 1) / 2``. Backward is 2x forward.
  Activation-checkpointing recompute is not counted (that would be hardware FLOPs utilisation, not MFU).

Peak: a table of dense bf16 tensor-core peaks for GPUs; on CPU a matmul peak measured once per process (per
thread count and dtype) and cached. ``$RLHF_PEAK_FLOPS`` overrides both.

Notation: S = sequences of the call, s_i = valid tokens of sequence i.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# Dense bf16 tensor-core peak (FLOP/s, no sparsity) by device-name substring; the first match wins, so more
# specific names come first ("H100 PCIe" before "H100").
GPU_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
)
_UNKNOWN_GPU_FLOPS = 100e12


@dataclass(frozen=True, kw_only=True)
class FlopsModel:
    """What the FLOP count needs from a model, read once when the worker builds it."""

    trained_linear_params: int  # in * out summed over nn.Linear layers whose weight trains
    frozen_linear_params: int  # the same for frozen ones (the LoRA base, a frozen head)
    num_layers: int  # decoder layers (0 when the config does not say: no attention term)
    num_heads: int  # query heads
    head_dim: int

    def train_flops(self, seq_lens: Sequence[int]) -> float:
        """FLOPs of forward + backward over sequences of these valid lengths."""
        tokens = sum(seq_lens)
        weights = (6.0 * self.trained_linear_params + 4.0 * self.frozen_linear_params) * tokens
        return weights + 3.0 * self._attention(seq_lens)

    def _attention(self, seq_lens: Sequence[int]) -> float:
        # Causal pairs s(s+1)/2 per sequence, 2 matmuls x 2 FLOPs per multiply-add, per head dim and layer.
        pairs = sum(s * (s + 1) / 2 for s in seq_lens)
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs


def _text_config(module: nn.Module) -> object | None:
    config = getattr(module, "config", None)
    return getattr(config, "text_config", None) or config  # VLMs keep the decoder's sizes in text_config


def flops_model(module: nn.Module) -> FlopsModel:
    """The :class:`FlopsModel` of an HF model (plain, FSDP2-wrapped or PEFT): a DTensor's shape is global."""
    trained = frozen = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            weight = sub.weight
            macs = int(weight.shape[0]) * int(weight.shape[1])
            if weight.requires_grad:
                trained += macs
            else:
                frozen += macs
    config = _text_config(module)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if heads else 0))
    return FlopsModel(
        trained_linear_params=trained,
        frozen_linear_params=frozen,
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
    )


@functools.lru_cache(maxsize=8)
def measured_cpu_peak_flops(*, dtype: torch.dtype = torch.float32, num_threads: int | None = None) -> float:
    """The best matmul FLOP/s of this process on the host (measured once per dtype and thread count).

    A 1024 x 1024 matmul, repeated for about 0.2 s after a warm-up; the best of 3 rounds. It runs with the
    process's own torch thread count (workers pin ``OMP_NUM_THREADS``), which is what training gets.
    """
    del num_threads  # part of the cache key only
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b)  # warm-up (allocations, thread pool)
    best = 0.0
    for _ in range(3):
        reps, start = 0, time.perf_counter()
        while True:
            torch.matmul(a, b)
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed > 0.2 / 3:
                break
        best = max(best, 2.0 * n**3 * reps / elapsed)
    return best


def gpu_peak_flops(name: str) -> float:
    """Dense bf16 peak of the GPU called ``name`` (``torch.cuda.get_device_name``); 100 TFLOP/s if unknown."""
    for key, flops in GPU_PEAK_FLOPS:
        if key in name:
            return flops
    return _UNKNOWN_GPU_FLOPS


def peak_flops(device: torch.device, *, dtype: torch.dtype = torch.float32) -> float:
    """Peak FLOP/s of ``device``: ``$RLHF_PEAK_FLOPS``, else the GPU table, else the measured CPU matmul peak."""
    override = os.environ.get("RLHF_PEAK_FLOPS")
    if override:
        return float(override)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    return measured_cpu_peak_flops(dtype=dtype, num_threads=torch.get_num_threads())


def mfu(*, flops: float, seconds: float, device: torch.device) -> float:
    """Model FLOPs utilisation of ``flops`` done by one rank in ``seconds``."""
    return flops / max(seconds, 1e-9) / peak_flops(device)


def memory_metrics(device: torch.device, *, prefix: str) -> dict[str, float]:
    """Peak memory in GiB (since the process started, or since the profiler last reset the CUDA peak).

    CUDA: ``max_memory_allocated`` / ``max_memory_reserved`` of the caching allocator. CPU: torch has no host
    allocator statistics, so this reports the process's resident set size now (``cpu_rss_gb``) and its
    high-water mark (``cpu_peak_rss_gb``, ``ru_maxrss``: the peak since the process started, it cannot be reset).
    """
    if device.type == "cuda":
        return {
            f"{prefix}/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            f"{prefix}/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    import resource

    import psutil

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        f"{prefix}/cpu_rss_gb": psutil.Process().memory_info().rss / 2**30,
        f"{prefix}/cpu_peak_rss_gb": peak_kib / 2**20,
    }
