"""The async pipeline (``rlhf_ops.trainer.async_pipeline``) on a real rollout group of the tiny model in this
process: admission bounds the lag, a deeper buffer makes stale batches that are dropped (and generated again)
or corrected, and a checkpoint's buffer is kept or regenerated on resume, never both.

Notation: 4 prompts x n=2, 2 per batch (B = 4 rows), R = 3; the "actor" is an HF model whose weights the test
changes after each update.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_ops.config import derive_batch_plan, load_config
from rlhf_ops.config.async_trainer import AsyncRolloutConfig
from rlhf_ops.data.dataset import PromptDataset, PromptLoader
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.tracking.logger import JsonlLogger
from rlhf_ops.trainer.async_pipeline import AsyncPipeline
from rlhf_ops.trainer.ppo_trainer import PPOTrainer
from rlhf_ops.trainer.reward import RewardStage
from rlhf_ops.trainer.timing import StageTimer
from tests.unit.trainer.test_controller import SMALL, CharTokenizer, FakeActorRolloutRef, exact
from tests.unit.trainer.test_controller import _loader as _controller_loader
from workers.rollout.async_group import AsyncRolloutGroup
from workers.rollout.async_rollout_worker import RolloutWorkerSpec

N = 2


class Actor:
    """The weight source: a real model; :meth:`update` stands for an optimizer step (weights change)."""

    def __init__(self, model_dir: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def update(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.01)


def _loader() -> PromptLoader:
    dataset = PromptDataset(
        prompt_ids=[[5, 6], [7], [8, 9], [10], [11, 12], [13], [14], [15, 16]],
        raw_prompts=list("abcdefgh"),
        ground_truths=["1"] * 8,
        data_sources=["toy"] * 8,
    )
    return PromptLoader(dataset, batch_size=2, pad_token_id=0, seed=1)


def _pipeline(model_dir: str, actor: Actor, **async_kw: object) -> tuple[AsyncPipeline, AsyncRolloutGroup]:
    config = load_config("tiny-cpu", ["rollout.max_new_tokens=3"])
    spec = RolloutWorkerSpec(
        model_path=model_dir, rollout=config.rollout, pad_token_id=0, eos_token_id=(2,), max_prompt_length=4, seed=3
    )
    group = AsyncRolloutGroup.local(spec, num_workers=1)
    sampling = SamplingParams(temperature=1.0, response_length=3, eos_token_id=(2,), pad_token_id=0)
    pipeline = AsyncPipeline(
        group,
        actor,
        _loader(),
        n=N,
        sampling=lambda: sampling,
        total_steps=4,
        config=AsyncRolloutConfig(**async_kw),  # type: ignore[arg-type]
    )
    return pipeline, group


def _step(pipeline: AsyncPipeline, actor: Actor, step: int) -> dict[str, float]:
    timer = StageTimer()
    batch, _, lag = pipeline.next_batch(step, timer)
    assert len(batch) == 2 * N and "token_policy_version" not in batch.tensors.keys()
    while any(b.generated is None for b in pipeline._batches.values()):  # the update waits: versions are exact
        pipeline._collect(0.5)
    actor.update()
    metrics = pipeline.after_update(step, timer)
    return {"lag": lag, **metrics}


def test_lag_stays_within_the_default_depth(tiny_model_dir: str) -> None:
    actor = Actor(tiny_model_dir)
    pipeline, group = _pipeline(tiny_model_dir, actor, max_staleness=1)
    try:
        metrics = [_step(pipeline, actor, step) for step in range(1, 5)]
    finally:
        group.shutdown()
    assert [m["lag"] for m in metrics][0] == 0.0
    assert all(m["training/policy_lag_max"] <= 1.0 for m in metrics)
    assert all(m["async/dropped_rows"] == 0.0 for m in metrics)
    assert all(0.0 <= m["async/rollout_idle_frac"] <= 1.0 for m in metrics)
    assert all(0.0 <= m["async/trainer_idle_frac"] <= 1.0 for m in metrics)


@pytest.mark.parametrize("policy", ["drop", "correct"])
def test_a_deeper_buffer_makes_stale_batches(tiny_model_dir: str, policy: str) -> None:
    actor = Actor(tiny_model_dir)
    pipeline, group = _pipeline(tiny_model_dir, actor, max_staleness=0, buffer_batches=3, stale_policy=policy)
    try:
        metrics = [_step(pipeline, actor, step) for step in range(1, 4)]
    finally:
        group.shutdown()
    last = metrics[-1]
    if policy == "drop":  # steps 2 and 3 were admitted at version 0: generated again, then trained on-policy
        assert last["async/dropped_rows"] == 2 * 2 * N and last["async/corrected_rows"] == 0.0
        assert all(m["training/policy_lag_max"] == 0.0 for m in metrics)
    else:  # trained as they are, with their lag
        assert last["async/corrected_rows"] == 2 * 2 * N and last["async/dropped_rows"] == 0.0
        assert [m["training/policy_lag_max"] for m in metrics] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("mode", ["keep", "regenerate"])
def test_resume_keeps_or_regenerates_the_buffer_never_both(tiny_model_dir: str, mode: str) -> None:
    actor = Actor(tiny_model_dir)
    pipeline, group = _pipeline(tiny_model_dir, actor, max_staleness=2, resume_buffer=mode)
    try:
        _step(pipeline, actor, 1)  # batches 2 and 3 admitted at version 0, 4 at version 1
        while any(b.generated is None for b in pipeline._batches.values()):
            pipeline._collect(0.5)
        saved_loader, saved = pipeline.loader_state(), pipeline.state_dict()
        saved_rows = {r["step"]: r["tensors"] for r in saved["batches"]}
    finally:
        group.shutdown()
    assert sorted(saved_rows) == [2, 3, 4]
    assert all((rows is not None) == (mode == "keep") for rows in saved_rows.values())
    resumed, group = _pipeline(tiny_model_dir, actor, max_staleness=2, resume_buffer=mode)
    try:
        resumed.loader.load_state_dict(saved_loader)
        resumed.load_state_dict(saved)
        kept, regenerated = resumed.counts["resume_kept_rows"], resumed.counts["resume_regenerated_rows"]
        assert kept + regenerated == 3 * 2 * N  # every pending row once
        assert (kept, regenerated) == ((6 * N, 0) if mode == "keep" else (0, 6 * N))
        metrics = _step(resumed, actor, 2)
        assert metrics["async/resume_kept_rows"] == kept and metrics["async/resume_regenerated_rows"] == regenerated
        if mode == "keep":  # the buffered batch was trained as saved: generated at version 0, lag 1
            assert metrics["training/policy_lag_max"] == 1.0
        else:  # generated again with the resumed actor's weights (version 1)
            assert metrics["training/policy_lag_max"] == 0.0
        assert _step(resumed, actor, 3)["async/resume_kept_rows"] == 0.0
    finally:
        group.shutdown()


class CountingActor(FakeActorRolloutRef):
    """The controller tests' actor whose weights are a real model's, changed by each update."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.weights = Actor(model_dir)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.calls.append(("full_state_dict", {}))
        return self.weights.full_state_dict()

    def update_actor(self, data: DataProto, *, temperature: float, step: int | None) -> dict[str, float]:
        metrics = super().update_actor(data, temperature=temperature, step=step)
        self.weights.update()
        return metrics


def test_the_controller_trains_from_the_rollout_group_and_pushes_weights_after_each_update(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    config = load_config("tiny-cpu", [*SMALL, "trainer.pipeline=async", "rollout.temperature=1.0"])
    loader = _controller_loader(config)
    actor = CountingActor(tiny_model_dir)
    spec = RolloutWorkerSpec(
        model_path=tiny_model_dir,
        rollout=config.rollout,
        pad_token_id=0,
        eos_token_id=(2,),
        max_prompt_length=4,
        seed=3,
    )
    group = AsyncRolloutGroup.local(spec)
    trainer = PPOTrainer(
        config,
        derive_batch_plan(config, steps_per_epoch=len(loader)),
        actor_rollout_ref=actor,
        critic=None,
        reward=RewardStage(tokenizer=CharTokenizer(), reward_fn=exact, reward_model=None),
        train_loader=loader,
        val_loader=None,
        logger=JsonlLogger(tmp_path / "metrics.jsonl"),
        tokenizer=CharTokenizer(),
        async_rollout=group,
    )
    try:
        trainer.fit()
    finally:
        group.shutdown()
    order = [name for name, _ in actor.calls if name in ("full_state_dict", "update_actor", "generate_sequences")]
    assert order == ["full_state_dict", *["update_actor", "full_state_dict"] * 3]  # the actor never generates
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1, 2, 3]
    assert all(row["training/policy_lag_max"] <= 1.0 and "async/rollout_idle_frac" in row for row in logged)
    trained = actor.calls_to("update_actor")[0]["tensors"]
    assert trained["responses"].shape == (4, 3)  # 2 prompts x n=2, R=3 from the tiny model's group
