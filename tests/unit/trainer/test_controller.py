"""The PPO controller (``rlhf_ops.trainer.ppo_trainer``) against fake roles that implement its Protocols.

No Ray and no model: the fake roles return small hand-made tensors and record what each call received, so the
tests see which keys every stage adds, the typed arguments of every call, the ReMax and KL-in-reward paths and
the resume state. The config, plan, loader, reward stage, advantage estimators and logger are the real ones.

Notation: B = rows of a step (2 prompts x n=2 = 4), P = prompt length (2), R = response length (3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlhf_ops.config import derive_batch_plan, load_config
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.data.dataset import PromptDataset, PromptLoader
from rlhf_ops.padding import build_full_sequence, get_response_mask
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.tracking.logger import JsonlLogger
from rlhf_ops.trainer.ppo_trainer import PPOTrainer, with_keys
from rlhf_ops.trainer.reward import RewardStage
from rlhf_ops.trainer.roles import ActorRolloutRef, Critic
from rlhf_ops.trainer.timing import StageTimer

PAD, EOS, WRONG = 0, 2, 20
OLD_LOGP, REF_LOGP, ROLLOUT_LOGP, VALUE = -1.0, -1.5, -0.5, 0.25
# 2 prompts per step, 2 samples each, one-prompt mini-batches (2 optimizer steps: the update is off-policy).
SMALL = [
    "resources.nproc_per_node=1",
    "data.train_batch_size=2",
    "data.max_prompt_length=4",
    "rollout.n=2",
    "rollout.max_new_tokens=3",
    "rollout.temperature=0.7",
    "actor.ppo_mini_batch_size=1",
    "actor.ppo_micro_batch_size_per_gpu=1",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_micro_batch_size_per_gpu=1",
    "trainer.total_epochs=3",
    "trainer.total_training_steps=3",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
]
GEN_KEYS = {
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
}


class CharTokenizer:
    """Token i > 2 decodes to ``str(i)``; pad (0) and eos (2) are special."""

    pad_token_id, eos_token_id = PAD, EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if i not in (PAD, EOS))


def exact(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None) -> float:
    return 1.0 if solution_str == ground_truth else 0.0


class FakeActorRolloutRef:
    """:class:`ActorRolloutRef`: greedy answers are right, sampled rows alternate right / wrong (row parity)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _record(self, name: str, data: DataProto, **args: Any) -> None:
        self.calls.append((name, {"keys": set(data.tensors.keys()), "rows": len(data), **args}))

    def calls_to(self, name: str) -> list[dict[str, Any]]:
        return [args for called, args in self.calls if called == name]

    def generate_sequences(self, prompts: DataProto, sampling: SamplingParams, *, step: int | None) -> DataProto:
        self._record("generate_sequences", prompts, sampling=sampling, step=step)
        self.calls[-1][1]["uids"] = list(prompts.non_tensor_batch["uid"])
        answers = [int(gt) for gt in prompts.non_tensor_batch["ground_truth"]]
        first = [a if sampling.greedy or row % 2 == 0 else WRONG for row, a in enumerate(answers)]
        responses = torch.tensor([[token, EOS, PAD] for token in first])  # (B, R): 2 valid tokens each
        response_mask = get_response_mask(responses, eos_token_id=(EOS,))
        b = prompts.tensors
        full = build_full_sequence(
            b["input_ids"], prompt_mask=b["attention_mask"], responses=responses, response_mask=response_mask
        )
        tensors = {
            "prompts": b["input_ids"],
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": ROLLOUT_LOGP * response_mask,
            **full,
        }
        return DataProto.from_dict(tensors, meta_info={"timing": {"generate_sequences": 0.01}})

    def compute_log_prob(self, data: DataProto, *, temperature: float, step: int | None) -> DataProto:
        self._record("compute_log_prob", data, temperature=temperature, step=step)
        old = torch.full(data.tensors["responses"].shape, OLD_LOGP)
        return DataProto.from_dict({"old_log_probs": old}, meta_info={"timing": {"old_log_prob": 0.01}})

    def compute_ref_log_prob(self, data: DataProto, *, temperature: float, step: int | None) -> DataProto:
        self._record("compute_ref_log_prob", data, temperature=temperature, step=step)
        return DataProto.from_dict({"ref_log_prob": torch.full(data.tensors["responses"].shape, REF_LOGP)})

    def update_actor(self, data: DataProto, *, temperature: float, step: int | None) -> dict[str, float]:
        self._record("update_actor", data, temperature=temperature, step=step)
        self.calls[-1][1]["tensors"] = {k: v.clone() for k, v in data.tensors.items()}
        return {"actor/pg_loss": 0.5, "actor/grad_norm": 1.0}

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


class FakeCritic:
    """:class:`Critic` with a constant value."""

    def __init__(self) -> None:
        self.updates: list[dict[str, torch.Tensor]] = []
        self.value_keys: list[set[str]] = []

    def compute_values(self, data: DataProto, *, step: int | None) -> DataProto:
        self.value_keys.append(set(data.tensors.keys()))
        return DataProto.from_dict({"values": torch.full(data.tensors["responses"].shape, VALUE)})

    def update_critic(self, data: DataProto, *, step: int | None) -> dict[str, float]:
        self.updates.append({k: v.clone() for k, v in data.tensors.items()})
        return {"critic/vf_loss": 0.1}

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


def _loader(config: RunConfig) -> PromptLoader:
    # 4 prompts, answer token 11 + i: 2 steps per epoch.
    dataset = PromptDataset(
        prompt_ids=[[5, 6], [7], [8, 9], [10]],
        raw_prompts=["a", "b", "c", "d"],
        ground_truths=["11", "12", "13", "14"],
        data_sources=["toy"] * 4,
    )
    return PromptLoader(dataset, batch_size=config.data.train_batch_size, pad_token_id=PAD, seed=config.trainer.seed)


def _trainer(
    tmp_path: Path, overrides: list[str], *, critic: FakeCritic | None = None
) -> tuple[PPOTrainer, FakeActorRolloutRef]:
    config = load_config("tiny-cpu", [*SMALL, *overrides])
    loader = _loader(config)
    actor: ActorRolloutRef = FakeActorRolloutRef()
    role: Critic | None = critic
    trainer = PPOTrainer(
        config,
        derive_batch_plan(config, steps_per_epoch=len(loader)),
        actor_rollout_ref=actor,
        critic=role,
        reward=RewardStage(tokenizer=CharTokenizer(), reward_fn=exact, reward_model=None),
        train_loader=loader,
        val_loader=None,
        logger=JsonlLogger(tmp_path / "metrics.jsonl"),
        tokenizer=CharTokenizer(),
    )
    assert isinstance(actor, FakeActorRolloutRef)
    return trainer, actor


def test_each_stage_gets_typed_arguments_and_adds_only_its_keys(tmp_path: Path) -> None:
    trainer, actor = _trainer(tmp_path, [])  # GRPO + KL loss: old log-probs (2 mini-batches) and the reference
    metrics = trainer.step(trainer.train_loader.next_batch(), step=7)
    [gen] = actor.calls_to("generate_sequences")
    assert gen["sampling"] == SamplingParams(
        n=1,
        temperature=0.7,
        top_p=1.0,
        top_k=-1,
        do_sample=True,
        response_length=3,
        eos_token_id=(EOS,),
        pad_token_id=PAD,
    )
    assert (gen["rows"], gen["step"], gen["keys"]) == (4, 7, {"input_ids", "attention_mask", "position_ids"})
    scored = GEN_KEYS | {"token_level_scores"}
    [old] = actor.calls_to("compute_log_prob")
    assert old == {"keys": scored, "rows": 4, "temperature": 0.7, "step": 7}  # before the reference: no ref key
    [ref] = actor.calls_to("compute_ref_log_prob")
    assert ref == {"keys": scored | {"old_log_probs"}, "rows": 4, "temperature": 0.7, "step": 7}
    [update] = actor.calls_to("update_actor")
    added = {"old_log_probs", "ref_log_prob", "token_level_rewards", "advantages", "returns"}
    assert update["keys"] == scored | added and (update["temperature"], update["step"]) == (0.7, 7)
    assert [name for name, _ in actor.calls] == [
        "generate_sequences",
        "compute_log_prob",
        "compute_ref_log_prob",
        "update_actor",
    ]
    # Rows 0 and 2 (sample 0 of each prompt) are right: GRPO per group of 2, scores (1, 0) -> (+0.7071, -0.7071).
    t = update["tensors"]
    assert t["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(
        t["advantages"][:, 0], torch.tensor([0.7071, -0.7071, 0.7071, -0.7071]), atol=1e-4, rtol=0
    )
    assert torch.equal(t["token_level_rewards"], t["token_level_scores"])  # no KL in the reward
    for stage in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor"):
        assert metrics[f"timing_s/{stage}"] >= 0.0, stage
    assert metrics["timing_s/worker/old_log_prob"] == pytest.approx(0.01)
    assert metrics["critic/score/mean"] == pytest.approx(0.5)


def test_a_stage_returns_its_keys_and_leaves_the_batch_alone(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, [])
    batch = trainer.generate(trainer.train_loader.next_batch(), StageTimer(), step=1)
    before = set(batch.tensors.keys())
    added = trainer.old_log_prob(batch, StageTimer(), {}, step=1)
    assert set(added) == {"old_log_probs"} and set(batch.tensors.keys()) == before
    merged = with_keys(batch, added)
    assert set(merged.tensors.keys()) == before | {"old_log_probs"} and set(batch.tensors.keys()) == before


def test_an_on_policy_update_skips_the_old_log_prob_stage(tmp_path: Path) -> None:
    trainer, actor = _trainer(tmp_path, ["actor.ppo_mini_batch_size=2"])  # one mini-batch of one epoch
    metrics = trainer.step(trainer.train_loader.next_batch(), step=1)
    assert actor.calls_to("compute_log_prob") == [] and "timing_s/old_log_prob" not in metrics
    [update] = actor.calls_to("update_actor")
    assert "old_log_probs" not in update["keys"]  # the update uses its own first forward's log-probs


def test_remax_generates_a_greedy_baseline_per_prompt_first(tmp_path: Path) -> None:
    trainer, actor = _trainer(tmp_path, ["algorithm.adv_estimator=remax", "algorithm.use_kl_loss=false"])
    metrics = trainer.step(trainer.train_loader.next_batch(), step=2)
    greedy, sampled = actor.calls_to("generate_sequences")
    assert (greedy["rows"], greedy["sampling"].do_sample, greedy["step"]) == (2, False, 2)  # prompts, not repeated
    assert (sampled["rows"], sampled["sampling"].do_sample) == (4, True)
    assert greedy["sampling"].temperature == sampled["sampling"].temperature == 0.7
    [update] = actor.calls_to("update_actor")
    t = update["tensors"]
    # Greedy answers are right: baseline 1 for both prompts, repeated n=2 times. ReMax: adv = score - baseline
    # on every valid token, so the right samples get 0 and the wrong ones -1.
    assert t["reward_baselines"].tolist() == [1.0, 1.0, 1.0, 1.0]
    expected = torch.tensor([0.0, -1.0, 0.0, -1.0])[:, None] * t["response_mask"]
    torch.testing.assert_close(t["advantages"], expected)
    assert metrics["timing_s/gen_max"] >= 0.0
    assert "compute_ref_log_prob" not in [name for name, _ in actor.calls]  # no KL anywhere: no reference


def test_kl_in_the_reward_with_a_critic(tmp_path: Path) -> None:
    critic = FakeCritic()
    overrides = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=false",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.kl_penalty=kl",
        "algorithm.gamma=1.0",
        "algorithm.lam=1.0",
    ]
    trainer, actor = _trainer(tmp_path, overrides, critic=critic)
    metrics = trainer.step(trainer.train_loader.next_batch(), step=1)
    assert critic.value_keys == [GEN_KEYS | {"token_level_scores", "old_log_probs", "ref_log_prob"}]
    [update] = actor.calls_to("update_actor")
    t = update["tensors"]
    mask = t["response_mask"].float()
    # k1 KL = old - ref = -1.0 - (-1.5) = 0.5 per valid token; rewards = scores - 0.1 * 0.5.
    torch.testing.assert_close(t["token_level_rewards"], t["token_level_scores"] - 0.05 * mask)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    # GAE with gamma = lam = 1: the return of a token is the sum of the rewards from it on; adv = return - value.
    # Row 0 (right): rewards (-0.05, 1 - 0.05) -> returns (0.9, 0.95); row 1 (wrong): (-0.1, -0.05).
    torch.testing.assert_close(t["returns"][0, :2], torch.tensor([0.9, 0.95]))
    torch.testing.assert_close(t["returns"][1, :2], torch.tensor([-0.1, -0.05]))
    [critic_batch] = critic.updates
    assert torch.equal(critic_batch["returns"], t["returns"]) and torch.equal(critic_batch["values"], t["values"])
    assert set(critic_batch) == set(t)  # the critic update sees the same batch as the actor's


def test_the_resume_state_round_trips_and_a_resumed_run_redoes_the_same_steps(tmp_path: Path) -> None:
    overrides = ["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true", "algorithm.use_kl_loss=false"]
    full, full_actor = _trainer(tmp_path / "full", overrides)
    full.fit()
    first, _ = _trainer(tmp_path / "first", [*overrides, "trainer.total_training_steps=2"])
    first.fit()
    state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint stores: plain JSON
    assert state["global_step"] == 2 and state["loader"] == {"epoch": 0, "position": 2}
    assert state["kl_ctrl"] != {} and len(state["history"]) == 2
    resumed, resumed_actor = _trainer(tmp_path / "resumed", overrides)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # the round trip: every field back, RNG included
    assert resumed.kl_ctrl.value == first.kl_ctrl.value != 0.001  # the adaptive coefficient moved and came back
    resumed.fit()
    # Step 3 starts epoch 1: the same prompts and the same step seed as the uninterrupted run's step 3.
    [third] = resumed_actor.calls_to("generate_sequences")
    assert (third["uids"], third["step"]) == (full_actor.calls_to("generate_sequences")[2]["uids"], 3)
    assert third["uids"][0].startswith("e1-")
    assert resumed.state.history == full.state.history
    assert resumed.kl_ctrl.value == pytest.approx(full.kl_ctrl.value, rel=1e-12)
    logged = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [3]


def test_a_plan_for_another_loader_is_refused(tmp_path: Path) -> None:
    config = load_config("tiny-cpu", SMALL)
    with pytest.raises(ValueError, match="steps_per_epoch=len"):
        PPOTrainer(
            config,
            derive_batch_plan(config),  # no steps_per_epoch: the trainer would not know the run's length
            actor_rollout_ref=FakeActorRolloutRef(),
            critic=None,
            reward=RewardStage(tokenizer=CharTokenizer(), reward_fn=exact, reward_model=None),
            train_loader=_loader(config),
            val_loader=None,
            logger=JsonlLogger(tmp_path / "m.jsonl"),
            tokenizer=CharTokenizer(),
        )
    assert np.isclose(derive_batch_plan(config, steps_per_epoch=2).total_steps or 0, 3)  # min(3 epochs x 2, 3)
