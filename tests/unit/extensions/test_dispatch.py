"""Dispatch reads the tables: the trainer's advantage stage, the actor's policy loss and the KL estimator call
a user's entry (from outside the package, by dotted path) exactly as they call a built-in."""

from __future__ import annotations

import numpy as np
import torch

from rlhf_ops.algorithms import compute_grpo_outcome_advantage, compute_policy_loss, kl_penalty
from rlhf_ops.config.schema import AlgorithmConfig
from rlhf_ops.protocol import DataProto
from rlhf_ops.trainer.advantage import compute_advantage
from tests.support import extension_entries
from workers.actor.dp_actor import bind_policy_loss

_E = "tests.support.extension_entries"


def _batch() -> DataProto:
    # Two prompts x two samples; the score sits on the last valid token.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    uid = np.array(["a", "a", "b", "b"], dtype=object)
    return DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": uid})


def test_builtin_estimator_through_the_table_equals_the_function() -> None:
    data = _batch()
    got = compute_advantage(data, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=False))
    want, _ = compute_grpo_outcome_advantage(
        data.tensors["token_level_rewards"], data.tensors["response_mask"], data.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=False,
    )  # fmt: skip
    assert torch.equal(got["advantages"], want.float())


def test_user_estimator_gets_index_and_its_config_field() -> None:
    extension_entries.CALLS.clear()
    cfg = AlgorithmConfig(adv_estimator=f"{_E}:centered_advantage", gamma=0.5)
    got = compute_advantage(_batch(), cfg)["advantages"]
    # Scores a: 1, 0 (mean 0.5) -> +-0.5; b: 3, 1 (mean 2) -> +-1; times gamma 0.5, on valid tokens only.
    want = torch.tensor([[0.25, 0.25], [-0.25, -0.25], [0.5, 0.5], [-0.5, 0.0]])
    torch.testing.assert_close(got, want)
    assert extension_entries.CALLS["advantage"] == 1


def test_user_policy_loss_is_bound_from_algorithm_fields() -> None:
    g = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(2, 3, generator=g) for _ in range(3))
    mask = torch.ones(2, 3)
    loss_fn = bind_policy_loss(AlgorithmConfig(policy_loss=f"{_E}:marked_policy_loss", entropy_coeff=0.25))
    loss, metrics = loss_fn(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    want, _ = compute_policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert torch.equal(loss, want)
    assert float(metrics["actor/test_policy_loss"]) == 1.25


def test_builtin_policy_loss_binding_is_unchanged() -> None:
    bound = bind_policy_loss(AlgorithmConfig(policy_loss="kl_cov", kl_cov_ratio=0.5, ppo_kl_coef=2.0))
    assert bound.keywords == {"kl_cov_ratio": 0.5, "ppo_kl_coef": 2.0}  # type: ignore[attr-defined]
    seeded = bind_policy_loss(AlgorithmConfig(policy_loss="clip_cov"), seed=3)
    assert set(seeded.keywords) == {"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "generator"}  # type: ignore[attr-defined]
    assert bind_policy_loss(AlgorithmConfig()) is compute_policy_loss


def test_user_kl_estimator_by_dotted_path() -> None:
    logprob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    kl = kl_penalty(logprob, torch.zeros(1, 2), f"{_E}:constant_value_kl")
    assert torch.equal(kl.detach(), torch.full((1, 2), extension_entries.KL_VALUE))
    kl.sum().backward()
    assert logprob.grad is not None and torch.equal(logprob.grad, torch.ones(1, 2))


def test_every_builtin_estimator_dispatches_as_its_direct_call() -> None:
    from rlhf_ops.algorithms import advantages as adv

    data = _batch()
    g = torch.Generator().manual_seed(1)
    values, baselines = torch.randn(4, 2, generator=g), torch.randn(4, generator=g)
    data = DataProto.from_dict(
        {**dict(data.tensors.items()), "values": values, "reward_baselines": baselines},
        non_tensors=dict(data.non_tensor_batch),
    )
    r, m, uid = data.tensors["token_level_rewards"], data.tensors["response_mask"], data.non_tensor_batch["uid"]
    cfg = AlgorithmConfig(gamma=0.9, lam=0.8)
    direct = {
        "gae": adv.compute_gae_advantage_return(r, values, m, 0.9, 0.8),
        "grpo": adv.compute_grpo_outcome_advantage(r, m, uid),
        "rloo": adv.compute_rloo_outcome_advantage(r, m, uid),
        "reinforce_plus_plus": adv.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.9),
        "reinforce_plus_plus_baseline": adv.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, uid),
        "remax": adv.compute_remax_outcome_advantage(r, baselines, m),
    }
    for name, (want_adv, want_ret) in direct.items():
        got = compute_advantage(data, cfg.model_copy(update={"adv_estimator": name}))
        assert torch.equal(got["advantages"], want_adv.float()), name
        assert torch.equal(got["returns"], want_ret.float()), name
