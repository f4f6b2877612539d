"""DataParallelPPOActor on one gloo rank: log-probs, hand-checked losses, micro-batch and dynamic-bsz invariance."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlhf_ops.config.batch_plan import PPOPlan
from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, OptimConfig
from rlhf_ops.protocol import DataProto
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from workers.actor import DataParallelPPOActor
from workers.fsdp import build_lr_scheduler, build_optimizer
from workers.fsdp.update_loop import MiniBatchUpdate
from workers.utils.prompt_group_attention import CALLS

R = 5  # response length of make_ppo_batch


def _actor(
    model: nn.Module, plan: PPOPlan, *, algorithm: AlgorithmConfig, config: ActorConfig
) -> DataParallelPPOActor:
    # eps=1e-4, not 1e-8: Adam's first update is lr * g / (|g| + eps), so with a tiny eps the float32 rounding
    # (~1e-9) of near-zero gradients moves those weights by up to lr and no two summation orders agree.
    optim = OptimConfig(lr=1e-3, eps=1e-4)
    opt = build_optimizer(model, optim)
    sched = build_lr_scheduler(opt, optim, total_steps=10)
    return DataParallelPPOActor(model, opt, sched, config=config, algorithm=algorithm, plan=plan)


def _full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _update(
    make: Callable[..., nn.Module],
    plan: PPOPlan,
    data: DataProto,
    algorithm: AlgorithmConfig,
    config: ActorConfig | None = None,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    model = make()  # a fresh copy of the same weights for every run
    actor = _actor(model, plan, algorithm=algorithm, config=config or ActorConfig())
    metrics = actor.update_policy(data)
    return metrics, _full_weights(model)


def test_compute_log_prob_equals_a_direct_log_softmax_gather(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch()
    plan = make_plan(log_prob_micro=3)  # 8 rows in micro-batches of 3, 3, 2
    actor = DataParallelPPOActor(fsdp_model(), config=ActorConfig(), algorithm=AlgorithmConfig(), plan=plan)
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True, temperature=0.7)
    b = data.batch
    with torch.no_grad():
        out = fsdp_model(wrap=False)(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        )
    logits = out.logits[:, -R - 1 : -1].float() / 0.7  # column t predicts token t + 1
    logp_all = torch.log_softmax(logits, dim=-1)  # (B, R, V)
    expected = logp_all.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    # Only response tokens are defined: a micro-batch's all-padding columns are cut before its forward and come
    # back as zeros (workers.utils.trim_padding); the direct forward computes them from pad tokens.
    m = b["response_mask"].bool()
    assert 0 < int(m.sum()) < m.numel()  # the batch holds padding columns
    torch.testing.assert_close(log_probs[m], expected[m], atol=1e-5, rtol=0)
    assert entropy is not None
    torch.testing.assert_close(entropy[m], (-(logp_all.exp() * logp_all).sum(-1))[m], atol=1e-5, rtol=0)


def test_dynamic_bsz_log_probs_equal_fixed_ones(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch(batch_size=12, seed=4)
    model = fsdp_model()
    fixed = DataParallelPPOActor(model, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan())
    dynamic = DataParallelPPOActor(
        model, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan(dynamic=True, max_token_len=24)
    )
    m = data.batch["response_mask"].bool()  # columns outside it depend on each micro-batch's cut (trim_padding)
    got, want = dynamic.compute_log_prob(data)[0], fixed.compute_log_prob(data)[0]
    torch.testing.assert_close(got[m], want[m], atol=1e-6, rtol=0)


def test_first_step_pg_loss_is_minus_the_mean_advantage(fsdp_model: Callable[..., nn.Module]) -> None:
    # With old_log_probs = current log-probs the ratio is 1 everywhere: no clipping, ppo_kl 0, and the
    # token-mean loss is -sum(A * mask) / sum(mask). ref = old makes the k3 KL loss exactly 0.
    data = make_ppo_batch()
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)
    model = fsdp_model()
    actor = _actor(
        model,
        make_plan(mini_per_rank=8, micro_per_rank=3, num_mini_batches=1),
        algorithm=algorithm,
        config=ActorConfig(),
    )
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    assert entropy is not None
    data.batch["old_log_probs"] = log_probs
    data.batch["ref_log_prob"] = log_probs
    metrics = actor.update_policy(data)
    adv, mask = data.batch["advantages"], data.batch["response_mask"].float()
    assert metrics["actor/pg_loss"] == pytest.approx(float(-(adv * mask).sum() / mask.sum()), rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-6
    assert abs(metrics["actor/kl_loss"]) < 1e-6 and metrics["actor/kl_coef"] == pytest.approx(0.1)
    assert metrics["actor/entropy"] == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-5)
    assert metrics["actor/lr"] == pytest.approx(1e-3) and metrics["actor/skipped_step_frac"] == 0.0
    assert metrics["actor/grad_norm"] > 0 and actor.last_update_tokens == int(data.batch["attention_mask"].sum())


CASES = [
    pytest.param(AlgorithmConfig(), id="token-mean"),
    pytest.param(
        AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, entropy_coeff=0.01),
        id="seq-mean+kl+ent",
    ),
    pytest.param(AlgorithmConfig(policy_loss="gspo", loss_agg_mode="seq-mean-token-sum-norm"), id="gspo"),
]


@pytest.mark.parametrize("algorithm", CASES)
def test_micro_1_x_accum_4_equals_micro_4_x_accum_1(
    fsdp_model: Callable[..., nn.Module], algorithm: AlgorithmConfig
) -> None:
    data = make_ppo_batch()  # 8 rows: 2 mini-batches of 4, i.e. 2 optimizer steps
    m1, w1 = _update(fsdp_model, make_plan(mini_per_rank=4, micro_per_rank=1), data, algorithm)
    m4, w4 = _update(fsdp_model, make_plan(mini_per_rank=4, micro_per_rank=4), data, algorithm)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-5, abs=1e-8), key
    if algorithm.policy_loss == "vanilla":
        assert m1["actor/pg_clipfrac"] > 0  # the batch exercises the clipped branch
    initial = _full_weights(fsdp_model(wrap=False))
    assert not torch.equal(w4["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
    for name in w1:
        torch.testing.assert_close(w1[name], w4[name], rtol=1e-5, atol=1e-7, msg=name)


def test_dynamic_bsz_update_equals_fixed_micro_batches(fsdp_model: Callable[..., nn.Module]) -> None:
    data = make_ppo_batch()
    algorithm = AlgorithmConfig(loss_agg_mode="seq-mean-token-sum")
    fixed, wf = _update(fsdp_model, make_plan(mini_per_rank=4, micro_per_rank=2), data, algorithm)
    dyn, wd = _update(fsdp_model, make_plan(mini_per_rank=4, dynamic=True, max_token_len=16), data, algorithm)
    assert dyn["actor/pg_loss"] == pytest.approx(fixed["actor/pg_loss"], rel=1e-5)
    assert dyn["actor/grad_norm"] == pytest.approx(fixed["actor/grad_norm"], rel=1e-5)
    for name in wf:
        torch.testing.assert_close(wd[name], wf[name], rtol=1e-5, atol=1e-7, msg=name)


def test_update_policy_errors_name_the_fix(fsdp_model: Callable[..., nn.Module]) -> None:
    model = fsdp_model()
    with pytest.raises(ValueError, match="plan.mesh.dp_size is 2"):
        DataParallelPPOActor(model, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan(dp_size=2))
    no_optim = DataParallelPPOActor(model, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan())
    with pytest.raises(ValueError, match="needs an optimizer"):
        no_optim.update_policy(make_ppo_batch())
    actor = _actor(model, make_plan(), algorithm=AlgorithmConfig(use_kl_loss=True), config=ActorConfig())
    with pytest.raises(ValueError, match="ref_log_prob"):
        actor.update_policy(make_ppo_batch().select(["input_ids", "attention_mask", "position_ids", "responses"]))


def test_gradient_sync_on_the_last_micro_batch_only_gives_the_same_update(
    fsdp_model: Callable[..., nn.Module],
) -> None:
    # fsdp.grad_sync_last_micro_batch: 4 micro-batches accumulate unsharded gradients and reduce-scatter once; the
    # sum of the reductions equals the reduction of the sum, so the weights after 2 optimizer steps must agree.
    data = make_ppo_batch()  # 8 rows: 2 mini-batches of 4 -> 4 micro-batches of 1 each
    plan = make_plan(mini_per_rank=4, micro_per_rank=1)
    algorithm = AlgorithmConfig()
    every, w_every = _update(fsdp_model, plan, data, algorithm)
    once_config = ActorConfig.model_validate({"fsdp": {"grad_sync_last_micro_batch": True}})
    once, w_once = _update(fsdp_model, plan, data, algorithm, once_config)
    assert once["actor/grad_norm"] == pytest.approx(every["actor/grad_norm"], rel=1e-5)
    for name in w_every:
        torch.testing.assert_close(w_once[name], w_every[name], rtol=1e-5, atol=1e-7, msg=name)
    # the flag only acts on FSDP2 modules (a plain module has no gradient reduction to postpone)

    def sync_once(model: nn.Module) -> bool:
        opt = build_optimizer(model, OptimConfig())
        update = MiniBatchUpdate(
            "actor",
            model,
            opt,
            None,
            plan=plan,
            grad_clip=1.0,
            loss_scale=1,
            dp_group=None,
            grad_sync_last_micro_batch=True,
        )
        return update.sync_once

    assert sync_once(fsdp_model()) and not sync_once(fsdp_model(wrap=False))


def test_attention_per_prompt_group_updates_as_the_dense_shared_prompt_row(
    fsdp_model: Callable[..., nn.Module],
) -> None:
    # actor.share_prompt_attention=per_prompt: two prompt groups of 2 rows per micro-batch of 4, attended one by one
    # on the FSDP2 module; the update's metrics and weights match the dense mask's to float rounding.
    data = make_ppo_batch()
    b = data.batch
    p = b["prompts"].shape[1]
    src = torch.arange(8) // 2 * 2  # rows 2k and 2k + 1 share row 2k's prompt
    b["prompts"] = b["prompts"][src]
    b["input_ids"][:, :p] = b["input_ids"][src, :p]
    b["attention_mask"][:, :p] = b["attention_mask"][src, :p]
    b["position_ids"] = (b["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    plan = make_plan(mini_per_rank=4, micro_per_rank=4)
    algorithm = AlgorithmConfig()
    dense_config = ActorConfig(use_remove_padding=True, share_prompt_prefix=True)
    dense, w_dense = _update(fsdp_model, plan, data, algorithm, dense_config)
    before = CALLS["per_prompt"]
    grouped_config = dense_config.model_copy(update={"share_prompt_attention": "per_prompt"})
    grouped, w_grouped = _update(fsdp_model, plan, data, algorithm, grouped_config)
    assert CALLS["per_prompt"] > before  # the FSDP2 module's layers attended per group
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert grouped[key] == pytest.approx(dense[key], rel=1e-4, abs=1e-7), key
    for name in w_dense:
        torch.testing.assert_close(w_grouped[name], w_dense[name], rtol=1e-4, atol=1e-6, msg=name)
