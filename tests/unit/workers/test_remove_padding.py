"""Packing a micro-batch into one row: indices by hand, and exactness against the padded forward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, CriticConfig
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from workers.actor import DataParallelPPOActor
from workers.critic import DataParallelPPOCritic
from workers.utils import pack_sequences, scatter_response


def test_pack_sequences_by_hand() -> None:
    # T = 5, R = 2 (response columns 3, 4). Row 0: pad, 5, 6 | 7, pad. Row 1: 8, 9, 10 | 11, 12.
    input_ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    pos = torch.tensor([[0, 0, 1, 2, 0], [0, 1, 2, 3, 4]])
    packed = pack_sequences(input_ids, mask, pos, response_length=2)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # restarts at each sequence
    # Columns 2 and 3 predict response columns 0 and 1: packed indices 1, 2 (row 0) and 5, 6 (row 1).
    assert packed.keep.tolist() == [1, 2, 5, 6]
    assert packed.labels.tolist() == [7, 8, 11, 12]  # 8 follows row 0's last token: masked (response pad)
    assert packed.rows.tolist() == [0, 0, 1, 1] and packed.cols.tolist() == [0, 1, 0, 1]
    out = scatter_response(torch.tensor([1.0, 2.0, 3.0, 4.0]), packed, batch_size=2, response_length=2)
    assert out.tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_log_probs_equal_padded_ones(fsdp_model: Callable[..., nn.Module], attn: str) -> None:
    data = make_ppo_batch(batch_size=6, seed=7)
    model = fsdp_model(attn=attn)
    plan = make_plan(log_prob_micro=6)
    padded = DataParallelPPOActor(model, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=plan)
    packed = DataParallelPPOActor(
        model, config=ActorConfig(use_remove_padding=True), algorithm=AlgorithmConfig(), plan=plan
    )
    mask = data.batch["response_mask"].bool()
    lp_pad, ent_pad = padded.compute_log_prob(data, calculate_entropy=True, temperature=0.9)
    lp_pack, ent_pack = packed.compute_log_prob(data, calculate_entropy=True, temperature=0.9)
    assert ent_pad is not None and ent_pack is not None
    torch.testing.assert_close(lp_pack[mask], lp_pad[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pack[mask], ent_pad[mask], atol=1e-5, rtol=0)


def test_packed_values_equal_padded_ones(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch(batch_size=6, seed=8)
    model = fsdp_model(kind="value")
    plan = make_plan(log_prob_micro=4)
    padded = DataParallelPPOCritic(model, config=CriticConfig(), algorithm=AlgorithmConfig(), plan=plan)
    packed = DataParallelPPOCritic(
        model, config=CriticConfig(use_remove_padding=True), algorithm=AlgorithmConfig(), plan=plan
    )
    torch.testing.assert_close(packed.compute_values(data), padded.compute_values(data), atol=1e-5, rtol=0)


def test_packed_update_equals_padded_update(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch(seed=9)
    plan = make_plan(mini_per_rank=8, micro_per_rank=4, num_mini_batches=1)
    metrics = []
    for remove_padding in (False, True):
        actor = DataParallelPPOActor(
            model := fsdp_model(),
            torch.optim.SGD(model.parameters(), lr=0.1),
            config=ActorConfig(use_remove_padding=remove_padding),
            algorithm=AlgorithmConfig(),
            plan=plan,
        )
        metrics.append(actor.update_policy(data))
    assert metrics[1]["actor/pg_loss"] == pytest.approx(metrics[0]["actor/pg_loss"], rel=1e-5)
    assert metrics[1]["actor/grad_norm"] == pytest.approx(metrics[0]["actor/grad_norm"], rel=1e-5)
