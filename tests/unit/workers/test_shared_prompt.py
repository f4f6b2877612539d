"""Shared-prompt packing (workers.utils.shared_prompt, ``actor.share_prompt_prefix``): each distinct prompt is
forwarded once and its responses attend to it; log-probs, entropy and gradients equal the padded forward's.

The model is the real SmolLM2-135M-Instruct cut to 2 decoder blocks (tests.support.shrunk_model), fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from rlhf_ops.padding import compute_position_ids
from rlhf_ops.seqlen_balancing import balance_groups_across_dp
from tests.support.shrunk_model import shrunk_smollm2
from workers.actor.forward import response_log_probs
from workers.utils.prompt_group_attention import (
    CALLS,
    PER_PROMPT_ATTENTION,
    enable_per_prompt_attention,
    prompt_groups,
)
from workers.utils.shared_prompt import pack_shared_prompts

PAD = 2  # SmolLM2: pad == eos


def _grouped_batch(
    prompts: list[list[int]], responses: list[tuple[int, list[int]]], *, p: int, r: int
) -> dict[str, Tensor]:
    """Rows (prompt index, response tokens): left-padded prompts in P = ``p`` columns, right-padded responses in R."""
    rows, masks = [], []
    for which, response in responses:
        prompt = prompts[which]
        pl, rl = len(prompt), len(response)
        rows.append(torch.tensor([PAD] * (p - pl) + prompt + response + [PAD] * (r - rl)))
        masks.append(torch.tensor([0] * (p - pl) + [1] * (pl + rl) + [0] * (r - rl)))
    mask = torch.stack(masks)
    return {"input_ids": torch.stack(rows), "attention_mask": mask, "position_ids": compute_position_ids(mask)}


def test_each_prompt_is_packed_once_and_each_response_token_is_predicted_by_the_right_position() -> None:
    prompts = [[11, 12, 13], [21, 22]]
    b = _grouped_batch(prompts, [(0, [31, 32]), (1, [41]), (0, [51, 52, 53])], p=4, r=3)
    packed = pack_shared_prompts(**b, response_length=3)
    assert packed is not None and packed.attention_mask is not None
    # Prompts first (in the order torch.unique sorts them), then the responses row after row.
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 41, 51, 52, 53]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 3, 4, 2, 3, 4, 5]]
    # First response token of a row: its prompt's last token (index 2 or 4); then the previous response token.
    assert packed.keep.tolist() == [2, 5, 4, 2, 8, 9]
    assert packed.labels.tolist() == [31, 32, 41, 51, 52, 53]
    assert packed.rows.tolist() == [0, 0, 1, 2, 2, 2] and packed.cols.tolist() == [0, 1, 0, 0, 1, 2]
    allowed = packed.attention_mask[0, 0]
    assert allowed.shape == (11, 11) and allowed.dtype == torch.bool
    # Row 2's last token (packed 10) sees prompt 0 and its own response, never row 0's response or prompt 1.
    assert allowed[10].nonzero().flatten().tolist() == [0, 1, 2, 8, 9, 10]
    assert allowed[7].nonzero().flatten().tolist() == [3, 4, 7]  # row 1: prompt 1 + itself
    assert allowed[4].nonzero().flatten().tolist() == [3, 4]  # prompt 1 never sees prompt 0
    additive = pack_shared_prompts(**b, response_length=3, mask_dtype=torch.float32)
    assert additive is not None and additive.attention_mask is not None
    assert torch.equal(additive.attention_mask[0, 0] == 0, allowed)


def test_no_shared_prompt_or_a_response_with_a_hole_in_its_padding_falls_back() -> None:
    distinct = _grouped_batch([[11, 12], [21]], [(0, [31]), (1, [41])], p=2, r=2)
    assert pack_shared_prompts(**distinct, response_length=2) is None
    same = _grouped_batch([[11, 12]], [(0, [31]), (0, [41, 42])], p=2, r=2)
    same["attention_mask"][1, 2] = 0  # a response whose first column is padding, its second not: not right-padded
    assert pack_shared_prompts(**same, response_length=2) is None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> nn.Module:
    from transformers import AutoModelForCausalLM

    path = shrunk_smollm2(str(tmp_path_factory.mktemp("smollm2-2l")), layers=2)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return m.eval()


def _log_probs_and_grads(
    model: nn.Module, batch: dict[str, Tensor], r: int, **kw: bool
) -> tuple[Tensor, Tensor, list[Tensor]]:
    model.zero_grad()
    log_probs, entropy = response_log_probs(model, **batch, response_length=r, calculate_entropy=True, **kw)
    assert entropy is not None
    (log_probs * batch["attention_mask"][:, -r:]).sum().backward()
    return log_probs, entropy, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_forward_gives_the_padded_log_probs_entropy_and_gradients_on_fewer_tokens(
    model: nn.Module, attn: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in (23, 17)]
    rows = [(i % 2, torch.randint(10, 1000, (1 + (5 * i) % 9,), generator=gen).tolist()) for i in range(8)]
    r = 10
    b = _grouped_batch(prompts, rows, p=25, r=r)
    model.config._attn_implementation = attn
    seen: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, args, _o: seen.append(args[0].numel()))
    try:
        got, got_entropy, got_grads = _log_probs_and_grads(model, b, r, share_prompts=True)
        want, want_entropy, want_grads = _log_probs_and_grads(model, b, r)
    finally:
        hook.remove()
        model.config._attn_implementation = "sdpa"
    mask = b["attention_mask"][:, -r:].bool()
    responses = int(mask.sum())
    assert seen[0] == 23 + 17 + responses  # each prompt once, not 4 times
    assert seen[1] > 2 * seen[0]  # the padded forward (padding trimmed) forwarded more than twice as many
    assert torch.allclose(got[mask], want[mask], atol=2e-5)
    assert torch.allclose(got_entropy[mask], want_entropy[mask], atol=2e-5)
    assert (got[~mask] == 0).all()  # outside the responses: zeros, as the packed forward leaves them
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-3), (g - w).abs().max()


def test_groups_move_whole_when_balancing_ranks() -> None:
    lengths = [10, 10, 30, 30, 5, 5, 20, 20]  # four groups of two rows: totals 20, 60, 10, 40
    mask = (torch.arange(32).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    order = balance_groups_across_dp(mask, uids, 2)
    assert order is not None
    halves = [order[:4].tolist(), order[4:].tolist()]
    for half in halves:  # each rank holds two whole groups, rows adjacent
        assert uids[half[0]] == uids[half[1]] and uids[half[2]] == uids[half[3]]
    totals = sorted(sum(lengths[i] for i in half) for half in halves)
    assert totals == [60, 70]  # {b, c} and {a, d}: the best split of 20/60/10/40
    assert balance_groups_across_dp(mask, ["a", "a", "b", "b", "c", "c", "c", "d"], 2) is None  # unequal groups


def test_attention_per_prompt_group_gives_the_dense_rows_values_and_leaves_other_batches_to_sdpa(
    tmp_path: Path,
) -> None:
    """``actor.share_prompt_attention=per_prompt``: three prompt groups attended one by one; the same log-probs,
    entropy and gradients as the dense mask; a padded batch runs sdpa exactly as before."""
    from transformers import AutoModelForCausalLM

    path = shrunk_smollm2(str(tmp_path / "smollm2-2l"), layers=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in (23, 17, 9)]
    rows = [(i % 3, torch.randint(10, 1000, (1 + (5 * i) % 9,), generator=gen).tolist()) for i in range(12)]
    r = 10
    b = _grouped_batch(prompts, rows, p=25, r=r)
    mask = b["attention_mask"][:, -r:].bool()
    want, want_entropy, want_grads = _log_probs_and_grads(model, b, r, share_prompts=True)
    padded, _, _ = _log_probs_and_grads(model, b, r)

    assert enable_per_prompt_attention(model) == PER_PROMPT_ATTENTION
    assert enable_per_prompt_attention(model) == PER_PROMPT_ATTENTION  # idempotent
    before = dict(CALLS)
    got, got_entropy, got_grads = _log_probs_and_grads(model, b, r, share_prompts=True)
    assert CALLS["per_prompt"] - before["per_prompt"] == 2 and CALLS["dense"] == before["dense"]  # both layers
    torch.testing.assert_close(got[mask], want[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_entropy[mask], want_entropy[mask], atol=2e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-3), (g - w).abs().max()
    assert want[mask].abs().max() > 1.0  # real log-probs

    again, _, _ = _log_probs_and_grads(model, b, r)  # padded rows: sdpa's own mask, sdpa unchanged
    assert CALLS["dense"] - before["dense"] == 2
    assert torch.equal(again, padded)


def test_prompt_groups_are_read_only_from_a_block_diagonal_mask() -> None:
    b = _grouped_batch([[11, 12, 13], [21, 22]], [(0, [31, 32]), (1, [41]), (0, [51, 52, 53])], p=4, r=3)
    packed = pack_shared_prompts(**b, response_length=3)
    assert packed is not None and packed.attention_mask is not None
    found = prompt_groups(packed.attention_mask)
    assert found is not None
    groups, inverse = found
    # Prompt 0 (packed 0-2) with rows 0 and 2 (5, 6, 8-10); prompt 1 (3, 4) with row 1 (7).
    assert [idx.tolist() for idx, _ in groups] == [[0, 1, 2, 5, 6, 8, 9, 10], [3, 4, 7]]
    assert torch.equal(torch.cat([idx for idx, _ in groups])[inverse], torch.arange(11))
    leaky = packed.attention_mask.clone()
    leaky[0, 0, 7, 0] = True  # row 1 sees prompt 0's first token: not two independent groups
    assert prompt_groups(leaky) is None
    causal = torch.ones(11, 11, dtype=torch.bool).tril()[None, None]
    assert prompt_groups(causal) is None  # one group: dense sdpa costs the same


def test_attention_per_prompt_group_needs_sdpa(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = shrunk_smollm2(str(tmp_path / "smollm2-1l"), layers=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with pytest.raises(ValueError, match="set model.attn_implementation=sdpa, or actor.share_prompt_attention=dense"):
        enable_per_prompt_attention(model)
