"""Builders shared by the FSDP worker tests: a random PPO batch in the protocol's layout, configs, plans.

Imported as ``tests.unit.workers.fsdp_test_batch`` (pytest runs with ``pythonpath = ["."]``).
"""

from __future__ import annotations

import torch

from rlhf_ops.config.batch_plan import MeshPlan, PPOPlan
from rlhf_ops.protocol import DataProto

PAD_ID = 0


def make_ppo_batch(
    *, batch_size: int = 8, prompt_len: int = 6, response_len: int = 5, vocab: int = 84, seed: int = 0
) -> DataProto:
    """Left-padded prompts + right-padded responses of random lengths, with PPO / critic inputs.

    ``old_log_probs`` and ``ref_log_prob`` sit near log(1/84) = -4.43 (the tiny model is near uniform),
    so PPO ratios spread around 1 and some tokens are clipped at clip 0.2.
    """
    g = torch.Generator().manual_seed(seed)
    b, p, r = batch_size, prompt_len, response_len
    prompt_lens = torch.randint(2, p + 1, (b,), generator=g)
    response_lens = torch.randint(1, r + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p).unsqueeze(0) >= (p - prompt_lens).unsqueeze(1)).long()  # (B, P) left pad
    response_mask = (torch.arange(r).unsqueeze(0) < response_lens.unsqueeze(1)).long()  # (B, R) right pad
    prompts = torch.randint(4, vocab, (b, p), generator=g) * prompt_mask  # pad id 0
    responses = torch.randint(4, vocab, (b, r), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (B, T)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, T) 0 at the first valid token
    old_log_probs = -4.43 + 0.3 * torch.randn(b, r, generator=g)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": old_log_probs,
        "ref_log_prob": old_log_probs + 0.1 * torch.randn(b, r, generator=g),
        "advantages": torch.randn(b, 1, generator=g).expand(b, r) * response_mask,
        "values": 0.1 * torch.randn(b, r, generator=g) * response_mask,
        "returns": torch.randn(b, r, generator=g) * response_mask,
    }
    return DataProto.from_dict(tensors=tensors)


def make_plan(
    *,
    dp_size: int = 1,
    mini_per_rank: int = 4,
    micro_per_rank: int = 4,
    dynamic: bool = False,
    max_token_len: int = 64,
    log_prob_micro: int = 3,
    ppo_epochs: int = 1,
    num_mini_batches: int = 2,
) -> PPOPlan:
    """A hand-built plan (what ``derive_batch_plan`` would give for these per-rank sizes)."""
    mesh = MeshPlan(world_size=dp_size, dp_size=dp_size, sp_size=1, replicate_size=1, shard_size=dp_size)
    return PPOPlan(
        mesh=mesh,
        mini_batch_size=mini_per_rank * dp_size,
        mini_batch_size_per_rank=mini_per_rank,
        micro_batch_size_per_rank=micro_per_rank,
        num_mini_batches=num_mini_batches,
        ppo_epochs=ppo_epochs,
        use_dynamic_bsz=dynamic,
        max_token_len_per_rank=max_token_len,
        log_prob_micro_batch_size_per_rank=log_prob_micro,
        log_prob_max_token_len_per_rank=max_token_len,
    )
