"""The levers ``bench/update_breakdown.py`` measures must compute the update the platform computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BREAKDOWN = Path(__file__).resolve().parents[3] / "bench" / "update_breakdown.py"


def embedding_grad_in_place(model: torch.nn.Module) -> Any:
    spec = importlib.util.spec_from_file_location("update_breakdown", BREAKDOWN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.embedding_grad_in_place(model)


def _grads(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for ids in batches:  # micro-batches accumulating into .grad, as the update does
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_embedding_rows_added_in_place_give_autograds_gradient_and_undo_restores_it() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,  # the LM head's gradient reaches the same .grad through autograd
        pad_token_id=0,  # the embedding's padding row gets no gradient from it
    )
    model = LlamaForCausalLM(config)
    batches = [torch.randint(0, 300, (3, 20)) for _ in range(3)]  # repeated ids within and across micro-batches
    for ids in batches:
        ids[:, :2] = 0  # padding ids in every micro-batch
    reference = _grads(model, batches)
    undo = embedding_grad_in_place(model)
    patched = _grads(model, batches)
    undo()
    restored = _grads(model, batches)
    assert reference.keys() == patched.keys() == restored.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(patched[name], grad, atol=1e-6, rtol=1e-5, msg=name)  # fp32 sums in another order
        assert torch.equal(restored[name], grad), name
    assert reference["model.embed_tokens.weight"].abs().max() > 0.1  # a gradient that could have been wrong
