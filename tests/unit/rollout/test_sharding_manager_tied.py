"""The weight sync of a tied-embedding model sends the shared tensor under both of its names.

vLLM's in-place reload rebuilds each layer from the tensors it receives; a tied ``lm_head`` that receives
none keeps stale (CPU: pre-packed) weights, so the alias must be sent too (measured on vLLM in
``tests/integration/test_real_model_rollout.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.rollout.hf_rollout import HFRollout
from workers.rollout.sharding_manager import FSDPShardingManager


class _TiedLM(nn.Module):
    """embed (V=6, H=4) -> linear (4x4) -> head tied to embed: 24 + 16 + 4 = 44 floats, 3 unique tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameter_is_sent_under_each_name_in_module_order() -> None:
    model = _TiedLM()
    manager = FSDPShardingManager(model, HFRollout(model, pad_token_id=0, eos_token_id=2), bucket_bytes=64)
    sent = list(manager.iter_full_weights())
    assert [name for name, _ in sent] == ["embed.weight", "body.weight", "body.bias", "head.weight"]
    assert torch.equal(sent[3][1], sent[0][1]) and torch.equal(sent[0][1], model.embed.weight)
    with manager:
        pass
    # 4 tensors, 24 + 16 + 4 + 24 = 68 floats = 272 bytes (the alias is counted: it is gathered again).
    assert manager.last_metrics["weight_sync/num_tensors"] == 4
    assert manager.last_metrics["weight_sync/bytes"] == 272


def test_untied_model_sends_each_parameter_once() -> None:
    model = _TiedLM()
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untie
    manager = FSDPShardingManager(model, HFRollout(model, pad_token_id=0, eos_token_id=2), bucket_bytes=1 << 20)
    assert [name for name, _ in manager.iter_full_weights()] == [
        "embed.weight",
        "body.weight",
        "body.bias",
        "head.weight",
    ]


def test_a_tied_inference_copy_follows_the_trained_tied_model() -> None:
    torch.manual_seed(0)
    policy, copy = _TiedLM(), _TiedLM()  # different random inits
    manager = FSDPShardingManager(policy, HFRollout(copy, pad_token_id=0, eos_token_id=2), bucket_bytes=64)
    with manager:
        pass
    assert torch.equal(copy.embed.weight, policy.embed.weight) and copy.head.weight is copy.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(copy.head(copy.body(copy.embed(ids))), policy.head(policy.body(policy.embed(ids))))
