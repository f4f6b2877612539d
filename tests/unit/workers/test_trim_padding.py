"""Padding columns cut before a padded forward (workers.utils.trim_padding): same log-probs, values and
gradients as the full-width forward, on fewer columns.

The model is the real SmolLM2-135M-Instruct cut to 2 decoder blocks (tests.support.shrunk_model), fp32, sdpa.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from rlhf_ops.padding import compute_position_ids
from tests.support.shrunk_model import shrunk_smollm2
from workers.actor.forward import _padded_logits, _token_log_probs, response_log_probs
from workers.utils.trim_padding import trim_padding_columns

PAD = 2  # SmolLM2: pad == eos


def _batch(prompt_lens: list[int], response_lens: list[int], *, p: int, r: int) -> dict[str, Tensor]:
    """Left-padded prompts of ``prompt_lens`` in P = ``p`` columns, right-padded responses in R = ``r``."""
    gen = torch.Generator().manual_seed(0)
    rows, masks = [], []
    for pl, rl in zip(prompt_lens, response_lens, strict=True):
        prompt = torch.randint(10, 1000, (pl,), generator=gen)
        response = torch.randint(10, 1000, (rl,), generator=gen)
        rows.append(torch.cat([torch.full((p - pl,), PAD), prompt, response, torch.full((r - rl,), PAD)]))
        masks.append(torch.cat([torch.zeros(p - pl), torch.ones(pl + rl), torch.zeros(r - rl)]).long())
    mask = torch.stack(masks)
    return {"input_ids": torch.stack(rows), "attention_mask": mask, "position_ids": compute_position_ids(mask)}


def test_only_edge_columns_that_are_padding_in_every_row_are_cut() -> None:
    b = _batch([5, 3], [2, 4], p=8, r=6)  # longest prompt 5 of 8, longest response 4 of 6
    trim = trim_padding_columns(**b, response_length=6)
    assert trim.input_ids.shape == (2, 5 + 4) and trim.response_length == 4 and trim.cut_right == 2
    assert torch.equal(trim.input_ids, b["input_ids"][:, 3:12])
    assert torch.equal(trim.position_ids, b["position_ids"][:, 3:12])  # positions keep their values
    restored = trim.restore(torch.arange(8.0).view(2, 4) + 1)
    assert restored.shape == (2, 6) and restored[:, 4:].abs().sum() == 0 and restored[0, 0] == 1
    full = _batch([8, 8], [6, 6], p=8, r=6)  # nothing to cut
    assert trim_padding_columns(**full, response_length=6).input_ids is full["input_ids"]
    # A hole inside a row (an observation column) is not an edge: it stays; one response column always does.
    holed = _batch([4], [1], p=4, r=5)
    trim = trim_padding_columns(**holed, response_length=5)
    assert trim.response_length == 1 and trim.input_ids.shape == (1, 5)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> nn.Module:
    from transformers import AutoModelForCausalLM

    path = shrunk_smollm2(str(tmp_path_factory.mktemp("smollm2-2l")), layers=2)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return m.eval()


def test_trimmed_forward_gives_the_full_width_log_probs_entropy_and_gradients(model: nn.Module) -> None:
    r = 16
    b = _batch([9, 6, 7], [5, 3, 8], p=14, r=r)  # 5 leading and 8 trailing columns are padding everywhere
    response_mask = b["attention_mask"][:, -r:]
    seen: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[-1]))
    try:
        model.zero_grad()
        got, got_entropy = response_log_probs(model, **b, response_length=r, calculate_entropy=True)
        (got * response_mask).sum().backward()
        got_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        logits, labels = _padded_logits(model, **b, response_length=r, keep_logits=True)  # full width
        want, want_entropy = _token_log_probs(
            logits, labels, temperature=1.0, calculate_entropy=True, entropy_requires_grad=False
        )
        (want * response_mask).sum().backward()
    finally:
        hook.remove()
    assert seen == [9 + 8, 14 + r]  # the trimmed forward ran on 17 of 30 columns
    assert got.shape == want.shape == (3, r)
    m = response_mask.bool()
    assert torch.allclose(got[m], want[m], atol=1e-5, rtol=1e-5)  # random tokens: log-probs of -16 .. -38
    assert got_entropy is not None and want_entropy is not None
    assert torch.allclose(got_entropy[m], want_entropy[m], atol=1e-5, rtol=1e-5)
    assert got[:, 8:].abs().sum() == 0  # the cut columns come back as zeros (outside every row's mask)
    for g, p in zip(got_grads, model.parameters(), strict=True):
        assert p.grad is not None
        assert torch.allclose(g, p.grad, atol=1e-5, rtol=1e-4)
