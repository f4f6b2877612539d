"""DataParallelPPOCritic on one gloo rank: values, the value loss against a reference, micro-batch invariance."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from rlhf_ops.algorithms import compute_value_loss
from rlhf_ops.config.batch_plan import PPOPlan
from rlhf_ops.config.schema import AlgorithmConfig, CriticConfig, OptimConfig
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from workers.critic import DataParallelPPOCritic
from workers.fsdp import build_lr_scheduler, build_optimizer
from workers.utils.prompt_group_attention import CALLS
from workers.utils.shared_prompt import pack_shared_prompts

R = 5


def _critic(model: nn.Module, plan: PPOPlan, *, cliprange: float = 0.5) -> DataParallelPPOCritic:
    optim = OptimConfig(lr=1e-3, eps=1e-4)  # eps: see tests/unit/workers/test_dp_actor.py
    opt = build_optimizer(model, optim)
    return DataParallelPPOCritic(
        model,
        opt,
        build_lr_scheduler(opt, optim, total_steps=10),
        config=CriticConfig(cliprange_value=cliprange),
        algorithm=AlgorithmConfig(adv_estimator="gae"),
        plan=plan,
    )


def test_compute_values_reads_the_predicting_columns_and_masks(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch()
    critic = _critic(fsdp_model(kind="value"), make_plan(log_prob_micro=3))
    b = data.batch
    with torch.no_grad():
        out = fsdp_model(kind="value", wrap=False)(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        )
    expected = out.logits[:, -R - 1 : -1, 0] * b["response_mask"]  # (B, R): value of the prefix before each token
    torch.testing.assert_close(critic.compute_values(data), expected, atol=1e-6, rtol=0)


def test_vf_loss_with_values_equal_to_vpreds_is_half_the_mse(fsdp_model: Callable[..., nn.Module]) -> None:
    # values == vpreds at the first step: the clipped term equals the unclipped one, so
    # vf_loss = 0.5 * sum((v - R)^2 * mask) / sum(mask) and vf_clipfrac = 0.
    data = make_ppo_batch()
    critic = _critic(fsdp_model(kind="value"), make_plan(mini_per_rank=8, micro_per_rank=3, num_mini_batches=1))
    values = critic.compute_values(data)
    data.batch["values"] = values
    returns, mask = data.batch["returns"], data.batch["response_mask"].float()
    metrics = critic.update_critic(data)
    expected = 0.5 * float(((values - returns) ** 2 * mask).sum() / mask.sum())
    assert metrics["critic/vf_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["critic/vf_clipfrac"] == 0.0
    assert metrics["critic/vpred_mean"] == pytest.approx(float((values * mask).sum() / mask.sum()), rel=1e-5)
    assert metrics["critic/grad_norm"] > 0 and metrics["critic/lr"] == pytest.approx(1e-3)


def test_clipped_vf_loss_matches_the_reference_and_is_split_invariant(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch(seed=5)  # values are random (not the critic's): the clip is active
    critic = _critic(fsdp_model(kind="value"), make_plan(mini_per_rank=8, micro_per_rank=8, num_mini_batches=1))
    vpreds = critic.compute_values(data)
    b = data.batch
    ref, ref_metrics = compute_value_loss(vpreds, b["returns"], b["values"], b["response_mask"], cliprange_value=0.05)
    results = []
    for micro in (1, 8):
        model = fsdp_model(kind="value")
        critic = _critic(model, make_plan(mini_per_rank=8, micro_per_rank=micro, num_mini_batches=1), cliprange=0.05)
        results.append((critic.update_critic(data), model.score.weight.full_tensor().detach()))
    (m1, w1), (m8, w8) = results
    assert m8["critic/vf_loss"] == pytest.approx(float(ref), rel=1e-5)
    assert m8["critic/vf_clipfrac"] == pytest.approx(float(ref_metrics["critic/vf_clipfrac"]), rel=1e-5)
    assert 0 < m8["critic/vf_clipfrac"] < 1
    assert m1["critic/vf_loss"] == pytest.approx(m8["critic/vf_loss"], rel=1e-5)
    assert m1["critic/grad_norm"] == pytest.approx(m8["critic/grad_norm"], rel=1e-5)
    torch.testing.assert_close(w1, w8, rtol=1e-5, atol=1e-7)


def test_shared_prompt_values_and_update_equal_the_padded_ones(fsdp_model: Callable[..., nn.Module]) -> None:
    """``critic.share_prompt_prefix``: 8 rows, 2 prompts x 4 responses, values and the updated head match, with the
    packed row's attention dense or per prompt group (``critic.share_prompt_attention``)."""
    data = make_ppo_batch(seed=3)
    b = data.batch
    p = b["prompts"].shape[-1]
    for row in range(8):  # rows 0-3 share row 0's prompt, rows 4-7 row 4's
        src = 0 if row < 4 else 4
        for key in ("prompts", "attention_mask", "position_ids"):
            b[key][row, :p] = b[key][src, :p]
        b["position_ids"][row, p:] = b["attention_mask"][row].cumsum(0)[p:] - 1
    b["input_ids"] = torch.cat([b["prompts"], b["responses"]], dim=1)
    first = pack_shared_prompts(b["input_ids"][:4], b["attention_mask"][:4], b["position_ids"][:4], response_length=R)
    assert first is not None and first.input_ids.shape[-1] < int(b["attention_mask"][:4].sum())  # the prompt once
    results = []
    per_prompt = CriticConfig(share_prompt_prefix=True, share_prompt_attention="per_prompt")
    before = CALLS["per_prompt"]
    for config in (CriticConfig(), CriticConfig(share_prompt_prefix=True), per_prompt):
        model = fsdp_model(kind="value")
        optim = OptimConfig(lr=1e-3, eps=1e-4)
        opt = build_optimizer(model, optim)
        critic = DataParallelPPOCritic(
            model,
            opt,
            build_lr_scheduler(opt, optim, total_steps=10),
            config=config,
            algorithm=AlgorithmConfig(adv_estimator="gae"),
            # micro-batches of 8: both prompt groups in one, so per_prompt attends two groups one by one
            plan=make_plan(mini_per_rank=8, micro_per_rank=8, num_mini_batches=1, log_prob_micro=8),
        )
        values = critic.compute_values(data)
        metrics = critic.update_critic(data)
        results.append((values, metrics, model.score.weight.full_tensor().detach()))
    assert CALLS["per_prompt"] > before
    v0, m0, w0 = results[0]
    for v1, m1, w1 in results[1:]:
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=0)
        assert m1["critic/vf_loss"] == pytest.approx(m0["critic/vf_loss"], rel=1e-5)
        torch.testing.assert_close(w1, w0, rtol=1e-4, atol=1e-6)
