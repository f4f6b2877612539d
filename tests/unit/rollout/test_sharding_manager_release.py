"""The sharding manager syncs again when the engine discarded its weights on release (vLLM on CPU).

An engine that keeps its weights (the HF engine) is synced only when the policy changed; one whose ``release``
drops them (``weights_released``, as ``VLLMRollout`` with ``rollout.free_cache_engine`` on CPU) is synced on every
entry, so a rollout never runs on missing weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from workers.rollout.hf_rollout import HFRollout
from workers.rollout.sharding_manager import FSDPShardingManager


class _Releasing(HFRollout):
    """The HF engine on its own copy, whose release zeroes that copy (the weights are gone until a sync)."""

    weights_released = False

    def release(self) -> None:
        with torch.no_grad():
            for param in self.module.parameters():
                param.zero_()
        self.weights_released = True

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().update_weights(weights)
        self.weights_released = False


def _pair() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(4, 4), nn.Linear(4, 4)  # 16 + 4 floats = 80 bytes each


def test_an_engine_that_keeps_its_weights_is_synced_once() -> None:
    policy, copy = _pair()
    manager = FSDPShardingManager(policy, HFRollout(copy, pad_token_id=0, eos_token_id=2), bucket_bytes=1 << 10)
    with manager:
        pass
    with manager:
        pass
    assert manager.last_metrics["weight_sync/skipped"] == 1.0 and manager.last_metrics["weight_sync/bytes"] == 0
    assert torch.equal(copy.weight, policy.weight)


def test_an_engine_that_released_its_weights_is_synced_on_every_entry() -> None:
    policy, copy = _pair()
    engine = _Releasing(copy, pad_token_id=0, eos_token_id=2)
    manager = FSDPShardingManager(policy, engine, bucket_bytes=1 << 10)
    with manager:
        pass
    assert engine.weights_released and copy.weight.eq(0).all()  # released on exit
    with manager:  # the policy did not change, but the engine's copy is gone: synced again (80 bytes)
        assert torch.equal(copy.weight, policy.weight) and not engine.weights_released
    assert manager.last_metrics["weight_sync/skipped"] == 0.0 and manager.last_metrics["weight_sync/bytes"] == 80
