"""The torch side of :mod:`rlhf_ops.config.precision`: the FSDP2 policy and the CPU autocast wrapper.

GPU: ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)``: FSDP2 all-gathers each block's fp32
shards as bf16, runs it in bf16, and reduce-scatters the gradients in fp32 into fp32 shards.

CPU: FSDP2 keeps the gathered params in the master dtype and the module's ``forward`` runs under
``torch.autocast("cpu", dtype=compute)``; only the forward is wrapped (autograd replays each op's backward in
the dtype its forward used, and non-reentrant activation checkpointing restores the autocast state when it
recomputes a block). The output logits are bf16; :mod:`workers.actor.forward` casts them to fp32 before the
log-softmax.

Speed: bf16 matmuls are faster than fp32 only on CPUs with native bf16 (AVX512-BF16 or AMX). On an AVX2-only
CPU oneDNN emulates them: measured here (AMD EPYC, AVX2, 1 thread) a (512 x 576) @ (576 x 1536) linear took
0.46 s in bf16 vs 0.059 s in fp32 (7.8x slower); :func:`enable_cpu_autocast` logs a warning on such CPUs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from rlhf_ops.config.precision import RolePrecision

__all__ = [
    "cpu_has_native_bf16",
    "enable_cpu_autocast",
    "flush_denormals",
    "keep_autocast_casts",
    "mixed_precision_policy",
]

_LOG = logging.getLogger(__name__)


def mixed_precision_policy(precision: RolePrecision | None) -> MixedPrecisionPolicy:
    """The FSDP2 policy: casts gathered params to ``compute`` only for the ``"fsdp2"`` mechanism.

    ``None`` (no resolved precision: plain FSDP2) keeps the params' dtype and reduces in fp32.
    """
    if precision is None:
        return MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=True)
    param_dtype = getattr(torch, precision.compute) if precision.mechanism == "fsdp2" else None
    return MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=getattr(torch, precision.reduce), cast_forward_inputs=True
    )


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def flush_denormals(device: torch.device) -> bool:
    """CPU compute: denormal fp32 results are flushed to zero and denormal inputs read as zero (FTZ / DAZ).

    x86 cores take a microcode assist on every denormal operand: measured here, one elementwise multiply over a
    (165, 49152) fp32 tensor of denormals took 19.8 ms against 1.6 ms flushed (2 threads). A softmax's gradient
    over a 49k vocabulary is mostly such values (p_k x upstream gradient with p_k < 1e-38). Values below 1.2e-38
    carry nothing a training step can use (AMX and CUDA bf16 units flush them anyway). The MXCSR flags belong to a
    thread, and threads start with their creator's: call this first in a worker process, before any parallel op
    starts the OpenMP pool. Returns whether the flags were set (False off CPU or where the CPU has no such mode).
    """
    if device.type != "cpu":
        return False
    return bool(torch.set_flush_denormal(True))


def enable_cpu_autocast(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Runs ``module``'s forward under ``torch.autocast("cpu", dtype=dtype)`` from now on (in place).

    The instance's ``forward`` is replaced by a wrapper (the class, its signature and FSDP2's pre/post
    forward hooks, which ``nn.Module.__call__`` runs around ``forward``, are untouched), so every caller
    (log-prob, update, HF generation) gets the same compute dtype without knowing about it.
    """
    if getattr(module, "_rlhf_autocast_dtype", None) == dtype:
        return module
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        _LOG.warning(
            "bf16 compute on a CPU without AVX512-BF16/AMX: oneDNN emulates bf16 matmuls, measured ~8x slower than "
            "fp32 on an AVX2 EPYC; set model.dtype=float32 on this machine unless you are testing the bf16 path."
        )
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            return inner(*args, **kwargs)

    module.forward = forward
    setattr(module, "_rlhf_autocast_dtype", dtype)  # noqa: B010 (nn.Module.__setattr__ types it as a submodule)
    return module


def _fold_into_master(shadow: Tensor, master: nn.Parameter) -> None:
    """Moves a bf16 copy's gradient into its fp32 master's ``.grad``: one fp32 buffer per mini-batch."""
    grad, shadow.grad = shadow.grad, None
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)  # fp32 += bf16 widens element by element, exactly: no fp32 temporary


@contextmanager
def keep_autocast_casts(module: nn.Module) -> Iterator[None]:
    """Inside the block (one mini-batch's forwards and backwards), ``module``'s weights are cast to bf16 once.

    Under CPU autocast each forward casts every fp32 weight to bf16 again (autocast's cache lives only until
    the outermost autocast block exits), and each backward turns every bf16 weight gradient into a new fp32
    tensor (the cast's ``ToCopyBackward``) before adding it to ``.grad``: for SmolLM2-135M, 135M elements
    each way per micro-batch, into freshly allocated (page-faulting) buffers. Here:

    - every ``nn.Linear`` weight is swapped, for the block, for a bf16 copy that is a leaf of its own (frozen
      weights too, without a gradient); autocast passes bf16 weights through uncast. After each backward a
      post-accumulate hook adds the copy's bf16 gradient into the fp32 master's ``.grad`` in place (what
      Megatron calls the fp32 ``main_grad`` accumulation). The values are those autocast computes: the same
      bf16 copies, the same bf16 gradients, widened exactly; only a weight that is also used outside a
      Linear (an embedding tied to the LM head) sums its two gradients in another order (fp32 rounding);
    - one autocast nesting level is held open, so any other weight autocast casts (a vision tower's
      convolution) is cast once per block too (autocast's own cache).

    Only for a module with CPU autocast (:func:`enable_cpu_autocast`) and plain parameters (FSDP2 swaps its
    unsharded parameters' storage between forwards); the weights must not change inside the block (the
    optimizer steps after it). Parameters are restored on exit, whatever happens. A no-op otherwise.
    """
    from torch.distributed.fsdp import FSDPModule

    dtype = getattr(module, "_rlhf_autocast_dtype", None)
    if dtype is None or isinstance(module, FSDPModule):
        yield
        return
    swapped: list[tuple[nn.Module, nn.Parameter, Tensor]] = []
    hooks = []
    torch.autocast_increment_nesting()
    try:
        for sub in module.modules():
            master = sub._parameters.get("weight") if isinstance(sub, nn.Linear) else None
            if not isinstance(master, nn.Parameter) or master.dtype == dtype:
                continue
            shadow = master.detach().to(dtype).requires_grad_(master.requires_grad)
            if master.requires_grad:
                hooks.append(
                    shadow.register_post_accumulate_grad_hook(functools.partial(_fold_into_master, master=master))
                )
            sub._parameters["weight"] = shadow  # type: ignore[assignment]  # bypasses __setattr__'s Parameter check
            swapped.append((sub, master, shadow))
        yield
    finally:
        for sub, master, shadow in swapped:
            _fold_into_master(shadow, master)  # nothing left after a complete backward; kept safe if one failed
            sub._parameters["weight"] = master
        for hook in hooks:
            hook.remove()
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
