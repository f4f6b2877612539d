"""Model FLOPs utilisation and memory metrics of one rank.

MFU = achieved FLOPs / peak FLOPs, with the usual dense-transformer estimate of 6 x N FLOPs per
trained token (forward 2N + backward 4N) and 2 x N per forward-only token.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# Dense bf16 peak of common accelerators (FLOP/s); unknown devices fall back to RLHF_PEAK_FLOPS.
_GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12}
# CPUs have no meaningful "peak"; a nominal 1 TFLOP/s keeps the metric comparable between runs here.
_CPU_NOMINAL_FLOPS = 1e12


def peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of ``device`` (``$RLHF_PEAK_FLOPS`` overrides the table)."""
    override = os.environ.get("RLHF_PEAK_FLOPS")
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        return 100e12
    return _CPU_NOMINAL_FLOPS


def num_parameters(module: nn.Module) -> int:
    """Parameters of the full (unsharded) model: a DTensor's ``numel`` is its global size."""
    return sum(p.numel() for p in module.parameters())


def mfu(*, num_params: int, tokens: int, seconds: float, device: torch.device, train: bool = True) -> float:
    """Model FLOPs utilisation of ``tokens`` processed in ``seconds`` on one rank."""
    flops = (6 if train else 2) * num_params * tokens
    return flops / max(seconds, 1e-9) / peak_flops(device)


def memory_metrics(device: torch.device, *, prefix: str) -> dict[str, float]:
    """Peak device memory (CUDA) or resident set size (CPU) in GiB."""
    if device.type == "cuda":
        return {
            f"{prefix}/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            f"{prefix}/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    import psutil

    return {f"{prefix}/cpu_rss_gb": psutil.Process().memory_info().rss / 2**30}
