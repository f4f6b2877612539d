"""MultiTurnRollout on the HF engine and the tiny model: masks with holes, log-probs, counters, seeds.

A random-init model rarely stops by itself, so the turns here end at any digit (``eos_token_id`` lists the
ten digit ids): most samples finish a turn early, get the ``answer_feedback`` grader's reply (observation
tokens, mask 0) and write again.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rlhf_ops.config.multi_turn import MultiTurnConfig
from rlhf_ops.models.tiny import build_tiny_tokenizer
from rlhf_ops.protocol import DataProto
from tests.support.rollout_calls import sampling_for
from tests.unit.rollout.test_hf_rollout import PAD, make_prompts, teacher_forced
from workers.rollout import HFRollout, RolloutEngine
from workers.rollout.multi_turn import MultiTurnRollout, maybe_multi_turn

R = 40
CFG = MultiTurnConfig(enable=True, interaction="answer_feedback", max_turns=3, max_tool_response_tokens=10)


@pytest.fixture(scope="module")
def model(tiny_model_dir: str) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def digits() -> list[int]:
    tokenizer = build_tiny_tokenizer()
    return [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]


def _rollout(model: LlamaForCausalLM, digits: list[int]) -> MultiTurnRollout:
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=digits, response_length=R, seed=3)
    return MultiTurnRollout(engine, CFG, tokenizer=build_tiny_tokenizer())


def _generate(rollout: MultiTurnRollout) -> DataProto:
    prompts = make_prompts()
    prompts.non_tensor_batch["ground_truth"] = __import__("numpy").array(["7", "6", "0"], dtype=object)
    return rollout.generate_sequences(prompts, sampling_for(rollout, n=4), step=1)


def test_wraps_only_when_enabled(model: LlamaForCausalLM, tiny_model_dir: str) -> None:
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=2)
    assert maybe_multi_turn(engine, MultiTurnConfig(), tokenizer_path=tiny_model_dir) is engine
    wrapped = maybe_multi_turn(engine, CFG, tokenizer_path=tiny_model_dir)
    assert isinstance(wrapped, MultiTurnRollout) and isinstance(wrapped, RolloutEngine)
    assert not wrapped.per_sample  # the HF engine runs in rounds (collective under FSDP)
    with pytest.raises(ValueError, match="schedule='per_sample' needs the async engine"):
        MultiTurnRollout(engine, CFG, tokenizer=build_tiny_tokenizer(), schedule="per_sample")


def test_masks_have_holes_and_log_probs_match_the_teacher_forced_recompute(
    model: LlamaForCausalLM, digits: list[int]
) -> None:
    out = _generate(_rollout(model, digits))
    b = out.batch
    assert b is not None
    mask, attended = b["response_mask"], b["attention_mask"][:, -R:]
    assert mask.shape == (12, R) and b["input_ids"].shape == (12, 8 + R)
    assert bool((mask <= attended).all())  # every model token is attended; observations are attended too
    observation = attended.bool() & ~mask.bool()
    has_hole = observation.any(-1)
    assert int(has_hole.sum()) >= 6, "most samples should get the grader's reply"
    # The engine's log-probs of model tokens equal the actor's teacher-forced forward over the whole response
    # (observations included as context): the rows are consistent for training.
    reference = teacher_forced(model, out)
    torch.testing.assert_close(b["rollout_log_probs"][mask.bool()], reference[mask.bool()], atol=1e-5, rtol=1e-5)
    assert bool((b["rollout_log_probs"][~mask.bool()] == 0).all())
    # Counters agree with the masks: one observation per hole, one model turn per model span.
    starts = torch.diff(torch.nn.functional.pad(mask, (1, 0)), dim=-1) == 1  # a model span starts
    obs_starts = torch.diff(torch.nn.functional.pad(observation.long(), (1, 0)), dim=-1) == 1
    torch.testing.assert_close(b["num_turns"], 1 + starts.sum(-1) + obs_starts.sum(-1))
    assert bool((b["interaction_turns"] == obs_starts.sum(-1)).all())
    assert int(b["num_turns"].max()) <= 1 + 3 + 2  # max_turns=3
    assert bool((b["tool_call_counts"] == 0).all())
    tokenizer = build_tiny_tokenizer()
    row = int(has_hole.nonzero()[0])
    text = tokenizer.decode(b["responses"][row][observation[row]].tolist())
    # The grader's reply, cut to 10 tokens (all taken by the note here) and rendered by the tiny chat template.
    assert text == "\n<|user|>\n<unk>Error: output cut at 10 tokens<unk>\n<|assistant|>"


def test_same_step_same_samples(model: LlamaForCausalLM, digits: list[int]) -> None:
    first, second = _generate(_rollout(model, digits)), _generate(_rollout(model, digits))
    assert first.batch is not None and second.batch is not None
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    assert torch.equal(first.batch["response_mask"], second.batch["response_mask"])
