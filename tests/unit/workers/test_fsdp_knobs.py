"""FSDP knobs on one gloo rank: the wrap policy (class list, parameter count), explicit prefetch.

The tiny Llama (2 layers, hidden 64, vocab 84, untied head) has per layer: q/k/v/o 4096 parameters each
(self_attn 16384), gate/up/down 8192 each (mlp 24576), two RMSNorms of 64; embed_tokens and lm_head 5376 each.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rlhf_ops.config.schema import FSDPConfig, FSDPWrapPolicyConfig
from tests.unit.workers.fsdp_test_batch import make_ppo_batch
from workers.fsdp import apply_fsdp2, build_device_mesh, load_hf_model
from workers.fsdp.wrap import select_wrap_modules


def _names(model: nn.Module, units: list[nn.Module]) -> set[str]:
    ids = {id(u) for u in units}
    return {name for name, m in model.named_modules() if id(m) in ids}


def test_size_policy_wraps_bottom_up_by_uncovered_parameters(tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    # 8192: each mlp linear (8192) is a unit, which leaves the mlp 0 uncovered; q/k/v/o (4096) are not, so
    # self_attn has 16384 uncovered -> a unit; a layer then has 128 (norms) left: not a unit.
    units = _names(model, select_wrap_modules(model, FSDPWrapPolicyConfig(min_num_params=8192)))
    expected = {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert units == expected | {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    # 20000: mlp (24576) is a unit; a layer keeps 16384 + 128 = 16512 < 20000; the ModuleList (33024) is a
    # container, never a unit, so LlamaModel gets 33024 + 5376 (embeddings) + 64 (norm) = 38464 -> a unit.
    units = _names(model, select_wrap_modules(model, FSDPWrapPolicyConfig(min_num_params=20000)))
    assert units == {"model.layers.0.mlp", "model.layers.1.mlp", "model"}


def test_size_policy_never_splits_tied_parameters(tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    model.lm_head.weight = model.model.embed_tokens.weight  # tie: embed_tokens, LlamaModel and lm_head hold it
    units = _names(model, select_wrap_modules(model, FSDPWrapPolicyConfig(min_num_params=5000)))
    assert "model.embed_tokens" not in units and "lm_head" not in units and "model" not in units


def test_class_policy_and_unknown_class(tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    policy = FSDPWrapPolicyConfig(transformer_layer_cls_to_wrap=["LlamaMLP", "LlamaAttention"])
    assert len(select_wrap_modules(model, policy)) == 4
    with pytest.raises(ValueError, match="matches no module of LlamaForCausalLM.*LlamaDecoderLayer"):
        select_wrap_modules(model, FSDPWrapPolicyConfig(transformer_layer_cls_to_wrap=["Qwen2DecoderLayer"]))


def _loss_and_grad(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    b = make_ppo_batch(seed=3).batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    loss = logits.float().square().mean()
    loss.backward()
    grad = model.get_parameter("model.layers.1.mlp.up_proj.weight").grad
    assert grad is not None
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return loss.detach(), full


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(FSDPConfig(wrap_policy=FSDPWrapPolicyConfig(min_num_params=8192)), id="size-8192"),
        pytest.param(FSDPConfig(wrap_policy=FSDPWrapPolicyConfig(min_num_params=20000)), id="size-20000"),
        pytest.param(FSDPConfig(forward_prefetch=2, backward_prefetch=2), id="prefetch-2"),
    ],
)
def test_knobs_keep_the_loss_and_gradient(
    fsdp_model: Callable[..., nn.Module], tiny_model_dir: str, cfg: FSDPConfig
) -> None:
    plain_loss, plain_grad = _loss_and_grad(fsdp_model(wrap=False))
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    apply_fsdp2(model, build_device_mesh(1), cfg)
    loss, grad = _loss_and_grad(model)
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, plain_grad, atol=1e-6, rtol=0)


def test_explicit_prefetch_lists(fsdp_model: Callable[..., nn.Module], tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm")
    apply_fsdp2(model, build_device_mesh(1), FSDPConfig(forward_prefetch=1, backward_prefetch=2))
    block0, block1 = model.model.layers[0], model.model.layers[1]
    assert isinstance(block0, FSDPModule) and isinstance(block1, FSDPModule)
    state0, state1 = block0._get_fsdp_state(), block1._get_fsdp_state()
    assert state0._states_to_forward_prefetch == [state1] and state1._states_to_forward_prefetch == []
    assert state1._states_to_backward_prefetch == [state0] and state0._states_to_backward_prefetch == []
