"""FSDP2 wrapping, model kinds, mesh validation and the rank-0 load on one gloo rank."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlhf_ops.config.schema import FSDPConfig
from tests.unit.workers.fsdp_test_batch import make_ppo_batch
from workers.fsdp import (
    apply_fsdp2,
    build_device_mesh,
    build_fsdp_model,
    find_decoder_blocks,
    get_device,
    load_full_state_dict,
    load_hf_model,
)


def _logits(model: nn.Module) -> torch.Tensor:
    batch = make_ppo_batch(seed=1).batch
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        )
    return out.logits


def test_apply_fsdp2_gives_the_plain_models_logits(fsdp_model: Callable[..., nn.Module]) -> None:
    plain, wrapped = fsdp_model(wrap=False), fsdp_model(wrap=True)
    torch.testing.assert_close(_logits(wrapped), _logits(plain), atol=1e-6, rtol=0)


def test_apply_fsdp2_shards_every_block_and_the_root(fsdp_model: Callable[..., nn.Module]) -> None:
    model = fsdp_model(wrap=True)
    blocks = find_decoder_blocks(model)
    assert len(blocks) == 2  # the tiny model has 2 decoder layers
    assert all(isinstance(b, FSDPModule) for b in blocks) and isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # State-dict keys are the HF ones (no wrapper prefixes): save_pretrained / DCP keep working.
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()


def test_activation_checkpointing_keeps_the_gradient(
    fsdp_model: Callable[..., nn.Module], tiny_model_dir: str
) -> None:
    plain = fsdp_model(wrap=False)
    ckpt = load_hf_model(tiny_model_dir, kind="causal_lm")
    apply_fsdp2(ckpt, build_device_mesh(1), FSDPConfig(activation_checkpointing=True))
    assert ckpt.is_gradient_checkpointing
    for m in (plain, ckpt):
        m.train()
        _logits_with_grad = m(input_ids=make_ppo_batch(seed=2).batch["input_ids"]).logits
        _logits_with_grad.square().mean().backward()
    g_plain = plain.model.layers[0].mlp.up_proj.weight.grad
    g_ckpt = ckpt.model.layers[0].mlp.up_proj.weight.grad.full_tensor()
    torch.testing.assert_close(g_ckpt, g_plain, atol=1e-7, rtol=1e-5)


def test_value_model_has_a_zero_bias_per_token_head(fsdp_model: Callable[..., nn.Module]) -> None:
    critic = fsdp_model(kind="value", wrap=False)
    assert critic.config.num_labels == 1 and critic.dropout.p == 0.0  # dropout 0.1 would break values == vpreds
    assert torch.equal(critic.score.bias, torch.zeros(1))
    assert 0.01 < float(critic.score.weight.detach().std()) < 0.03  # N(0, initializer_range = 0.02), 64 draws
    assert _logits(critic).shape == (8, 11, 1)  # (B, T = P + R, 1)


def test_meta_model_has_no_storage(tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm", meta=True)
    assert all(p.is_meta for p in model.parameters())


def test_build_fsdp_model_loads_rank0_weights(gloo_world1: None, tiny_model_dir: str) -> None:
    model = build_fsdp_model(
        tiny_model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu"
    )
    plain = load_hf_model(tiny_model_dir, kind="causal_lm")
    torch.testing.assert_close(_logits(model), _logits(plain), atol=1e-6, rtol=0)


def test_rank0_with_a_meta_model_is_rejected(gloo_world1: None, tiny_model_dir: str) -> None:
    model = load_hf_model(tiny_model_dir, kind="causal_lm", meta=True)
    apply_fsdp2(model, build_device_mesh(1), FSDPConfig())
    with pytest.raises(ValueError, match="rank 0 must hold the real model"):
        load_full_state_dict(model, {}, device="cpu")


def test_device_mesh_validation(gloo_world1: None) -> None:
    assert build_device_mesh(1).mesh_dim_names == ("fsdp",)
    with pytest.raises(ValueError, match="hsdp_replicate_size=2"):
        build_device_mesh(1, replicate_size=2)
    with pytest.raises(NotImplementedError, match="Ulysses"):
        build_device_mesh(1, sp_size=2)
    assert get_device("cpu") == torch.device("cpu")


def test_single_rank_plain_keeps_plain_parameters_and_loads_rank0_weights(
    gloo_world1: None, tiny_model_dir: str
) -> None:
    cfg = FSDPConfig(single_rank_plain=True)
    plain = build_fsdp_model(tiny_model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=cfg, device="cpu")
    wrapped = build_fsdp_model(
        tiny_model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu"
    )
    assert not isinstance(plain, FSDPModule)
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    torch.testing.assert_close(_logits(plain), _logits(wrapped), atol=1e-6, rtol=0)
    # bf16 compute on CPU: the autocast wrapper still applies without FSDP2
    bf16 = FSDPConfig.model_validate({"single_rank_plain": True, "mixed_precision": {"param_dtype": "bfloat16"}})
    model = apply_fsdp2(load_hf_model(tiny_model_dir, kind="causal_lm"), build_device_mesh(1), bf16)
    assert not isinstance(model, FSDPModule) and _logits(model).dtype == torch.bfloat16
