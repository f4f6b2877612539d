"""The levers ``bench/update_breakdown.py`` measures must compute the update the platform computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers.utils.prompt_group_attention import CALLS

BREAKDOWN = Path(__file__).resolve().parents[3] / "bench" / "update_breakdown.py"


def embedding_grad_in_place(model: torch.nn.Module) -> Any:
    spec = importlib.util.spec_from_file_location("update_breakdown", BREAKDOWN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.embedding_grad_in_place(model)


def _tiny_llama(**extra: Any) -> LlamaForCausalLM:
    """A 2-block Llama of vocabulary 300, pad id 0, with ``extra`` config keys."""
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        **extra,
    )
    return LlamaForCausalLM(config)


def _grads(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for ids in batches:  # micro-batches accumulating into .grad, as the update does
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_embedding_rows_added_in_place_give_autograds_gradient_and_undo_restores_it() -> None:
    torch.manual_seed(0)
    # tied: the LM head's gradient reaches the same .grad through autograd; the padding row gets none from it
    model = _tiny_llama(tie_word_embeddings=True)
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


def grouped_attention(model: torch.nn.Module) -> Any:
    spec = importlib.util.spec_from_file_location("update_breakdown", BREAKDOWN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.grouped_attention(model)


def _shared_prompt_batch(prompts: int, n: int, max_new: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts of different lengths, each sampled ``n`` times with right-padded responses."""
    rows, masks = [], []
    width = 5 + prompts
    for p in range(prompts):
        prompt = torch.randint(1, 300, (3 + p,)).tolist()
        for _ in range(n):
            length = int(torch.randint(1, max_new + 1, ()))
            response = torch.randint(1, 300, (length,)).tolist() + [0] * (max_new - length)
            rows.append([0] * (width - len(prompt)) + prompt + response)
            masks.append([0] * (width - len(prompt)) + [1] * (len(prompt) + length) + [0] * (max_new - length))
    attention_mask = torch.tensor(masks)
    return {
        "input_ids": torch.tensor(rows),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    }


def test_attention_per_prompt_group_gives_the_dense_masks_log_probs_and_gradients() -> None:
    from workers.actor.forward import response_log_probs

    torch.manual_seed(0)
    model = _tiny_llama(attn_implementation="sdpa")
    batch = _shared_prompt_batch(prompts=3, n=4, max_new=6)
    response_mask = batch["attention_mask"][:, -6:].float()

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        log_probs, _ = response_log_probs(
            model, **batch, response_length=6, share_prompts=True, use_remove_padding=True
        )
        (log_probs * response_mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return log_probs.detach() * response_mask, grads

    dense, dense_grads = run()
    undo = grouped_attention(model)
    before = CALLS["per_prompt"]
    grouped, grouped_grads = run()
    assert CALLS["per_prompt"] - before == 2  # both layers attended per group (3 groups each)
    undo()
    again, _ = run()
    torch.testing.assert_close(grouped, dense, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, dense)
    assert dense_grads.keys() == grouped_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert dense.abs().max() > 1.0  # real log-probs, not zeros
