"""One-step off-policy pipelining (``rlhf_ops.trainer.one_step_off``) in the real controller, against a fake
rollout group that generates "in the background" and records the weight version each rollout was sampled with.

The fake is ``test_controller``'s :class:`FakeActorRolloutRef` plus ``submit_sequences`` / ``collect_sequences``;
the weight version is its count of ``update_actor`` calls when a rollout is submitted, and it is written into
the rollout's log-probs, so the tests read which weights sampled the batch each update trains on.

Notation: 3 steps of 2 prompts x n=2 (B = 4 rows), R = 3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.config import derive_batch_plan, load_config
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.tracking.logger import JsonlLogger
from rlhf_ops.trainer.one_step_off import OneStepOffPipeline, decode_tensors, encode_tensors
from rlhf_ops.trainer.ppo_trainer import PPOTrainer
from rlhf_ops.trainer.reward import RewardStage
from tests.unit.trainer.test_controller import SMALL, CharTokenizer, FakeActorRolloutRef, _loader, exact

ONE_STEP_OFF = [
    "rollout.engine=vllm",
    "rollout.mode=async",
    "rollout.kv_cache_memory_bytes=67108864",
    "rollout.temperature=1.0",
    "trainer.pipeline=one_step_off",
    "algorithm.rollout_correction.rollout_is=token",
]


class FakePrefetchingRollout(FakeActorRolloutRef):
    """Submitted rollouts are generated at submit time with the current weight version (= updates so far)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.pending: tuple[DataProto, DataProto] | None = None

    def submit_sequences(self, prompts: DataProto, sampling: SamplingParams | None = None, *, step: int | None = None):
        assert self.pending is None, "submitted twice without a collect"
        assert sampling is not None
        out = self.generate_sequences(prompts, sampling, step=step)
        self.calls[-1] = ("submit_sequences", {**self.calls[-1][1], "version": self.version})
        out.tensors["rollout_log_probs"] = -(1.0 + self.version) * out.tensors["response_mask"]  # version inside
        self.pending = (prompts, out)
        return DataProto.from_dict({"submitted": torch.ones(len(prompts), dtype=torch.bool)})

    def collect_sequences(self, prompts: DataProto) -> DataProto:
        assert self.pending is not None and torch.equal(
            self.pending[0].tensors["input_ids"], prompts.tensors["input_ids"]
        )
        self.calls.append(("collect_sequences", {"rows": len(prompts)}))
        out, self.pending = self.pending[1], None
        return out

    def update_actor(self, data: DataProto, *, temperature: float, step: int | None) -> dict[str, float]:
        metrics = super().update_actor(data, temperature=temperature, step=step)
        self.version += 1
        return metrics


def _trainer(tmp_path: Path, overrides: list[str]) -> tuple[PPOTrainer, FakePrefetchingRollout]:
    config = load_config("tiny-cpu", [*SMALL, *ONE_STEP_OFF, *overrides])
    loader = _loader(config)
    actor = FakePrefetchingRollout()
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
    )
    return trainer, actor


def _logged(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_next_rollout_is_submitted_before_each_update_with_the_weights_before_it(tmp_path: Path) -> None:
    trainer, actor = _trainer(tmp_path, [])
    trainer.fit()
    order = [name for name, _ in actor.calls if name in ("submit_sequences", "collect_sequences", "update_actor")]
    assert order == [
        "submit_sequences",  # step 1's batch, generated synchronously at the start of step 1
        "collect_sequences",
        "submit_sequences",  # step 2's batch, in flight while step 1 trains
        "update_actor",
        "collect_sequences",
        "submit_sequences",  # step 3's batch (weights after update 1), in flight while step 2 trains
        "update_actor",
        "collect_sequences",
        "update_actor",  # the last step prefetches nothing
    ]
    submits = actor.calls_to("submit_sequences")
    assert [(s["step"], s["version"]) for s in submits] == [(1, 0), (2, 0), (3, 1)]
    # Each update trains on the rows the fake generated with version v: rollout_log_probs = -(1 + v) on tokens.
    trained = [u["tensors"]["rollout_log_probs"].min().item() for u in actor.calls_to("update_actor")]
    assert trained == [-1.0, -1.0, -2.0]
    rows = _logged(tmp_path / "metrics.jsonl")
    assert [r["training/policy_lag"] for r in rows] == [0.0, 1.0, 1.0]  # update k - 1 before step k's update
    assert [r["training/epoch"] for r in rows] == [0.0, 0.0, 1.0]  # the batch's epoch, not the prefetch's
    assert all(r["timing_s/gen"] >= 0 for r in rows)
    assert ["timing_s/gen_submit" in r for r in rows] == [True, True, False]  # the last step submits nothing


def test_sync_pipeline_never_prefetches(tmp_path: Path) -> None:
    trainer, actor = _trainer(tmp_path, ["trainer.pipeline=sync"])
    assert trainer.pipeline is None
    trainer.fit()
    assert not actor.calls_to("submit_sequences") and len(actor.calls_to("generate_sequences")) == 3
    assert all("training/policy_lag" not in r for r in _logged(tmp_path / "metrics.jsonl"))


def test_a_checkpoint_holds_the_prefetched_batch_and_a_resume_trains_on_it_exactly(tmp_path: Path) -> None:
    full, full_actor = _trainer(tmp_path / "full", [])
    full.fit()
    first, first_actor = _trainer(tmp_path / "first", [])
    for step in (1, 2):  # a run killed after committing step 2: step 3's rollout was in flight
        metrics, _ = first.pipelined_step(step)
        first.state.global_step = step
    state = json.loads(json.dumps(first.state_dict()))  # waits for the prefetch; plain JSON like the checkpoint
    assert first.pipeline is not None and first_actor.pending is None
    assert state["pipeline"]["step"] == 3 and state["pipeline"]["weight_version"] == 1
    assert state["loader"] == {"epoch": 0, "position": 2}  # before step 3's prompts: they travel as a batch
    third, _ = first.pipelined_step(3)  # the save's wait for the prefetch is reported on the step it feeds
    assert "timing_s/gen" in third and "timing_s/worker/generate_sequences" in third
    resumed, resumed_actor = _trainer(tmp_path / "resumed", [])
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # the round trip, the prefetched batch included
    resumed.fit()
    assert not resumed_actor.calls_to("submit_sequences")  # step 3 trains on the saved batch, nothing regenerated
    [want], [got] = full_actor.calls_to("update_actor")[2:], resumed_actor.calls_to("update_actor")
    assert set(got["tensors"]) == set(want["tensors"])
    for key, value in want["tensors"].items():
        torch.testing.assert_close(got["tensors"][key], value, rtol=0, atol=0, msg=key)
    logged = _logged(tmp_path / "resumed" / "metrics.jsonl")
    assert [(r["step"], r["training/policy_lag"], r["training/epoch"]) for r in logged] == [(3, 1.0, 1.0)]


def test_a_sync_checkpoint_resumes_with_a_synchronous_first_step_and_other_data_is_refused(tmp_path: Path) -> None:
    first, _ = _trainer(tmp_path / "first", [])
    first.pipelined_step(1)
    first.state.global_step = 1
    state = json.loads(json.dumps(first.state_dict()))
    sync_state = {k: v for k, v in state.items() if k != "pipeline"}
    resumed, actor = _trainer(tmp_path / "resumed", [])
    resumed.load_state_dict(sync_state)
    resumed.fit()
    assert [(s["step"], s["version"]) for s in actor.calls_to("submit_sequences")] == [(2, 0), (3, 0)]
    assert [r["training/policy_lag"] for r in _logged(tmp_path / "resumed" / "metrics.jsonl")] == [0.0, 1.0]
    state["pipeline"]["tensors"]["prompts"] = encode_tensors(
        DataProto.from_dict({"prompts": torch.zeros(4, 2, dtype=torch.long)}), ["prompts"]
    )["prompts"]
    other, _ = _trainer(tmp_path / "other", [])
    with pytest.raises(ValueError, match="does not match the prompts the loader draws"):
        other.load_state_dict(state)


def test_tensors_round_trip_exactly_through_json() -> None:
    tensors = {
        "ids": torch.tensor([[3, -1], [2**40, 0]]),
        "logp": torch.tensor([[-0.1234567, float("-inf")]]),
        "mask": torch.tensor([True, False]),
        "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }
    records = json.loads(json.dumps(encode_tensors(DataProto.from_dict({"ids": tensors["ids"]}), ["ids"])))
    torch.testing.assert_close(decode_tensors(records).tensors["ids"], tensors["ids"], rtol=0, atol=0)
    for key in ("logp", "half"):
        data = DataProto.from_dict({key: tensors[key]})
        back = decode_tensors(json.loads(json.dumps(encode_tensors(data, [key])))).tensors[key]
        assert back.dtype == tensors[key].dtype and torch.equal(back, tensors[key]), key
    for key in ("mask", "empty"):
        back = decode_tensors(encode_tensors(DataProto.from_dict({key: tensors[key]}), [key])).tensors[key]
        assert (
            back.dtype == tensors[key].dtype and back.shape == tensors[key].shape and torch.equal(back, tensors[key])
        )
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        decode_tensors({"x": {"dtype": "complex64", "shape": [1], "data": ""}})


def test_a_rollout_group_without_background_generation_is_refused(tmp_path: Path) -> None:
    config = load_config("tiny-cpu", [*SMALL, *ONE_STEP_OFF])
    with pytest.raises(TypeError, match="submit_sequences / collect_sequences"):
        OneStepOffPipeline(FakeActorRolloutRef(), _loader(config), n=2, sampling=lambda: None, total_steps=3)  # type: ignore[arg-type]
