"""HFRollout on the tiny model: greedy parity with a step-by-step reference, exact log-probs, EOS, n, seeds."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from rlhf_ops.padding import compute_position_ids, pad_sequences_left
from rlhf_ops.protocol import DataProto
from workers.rollout import HFRollout, RolloutEngine, SamplingParams
from workers.rollout.sampling import filter_logits

PAD, EOS, R = 0, 2, 6
PROMPTS = [[1, 19, 31, 32, 41, 71, 69, 14], [1, 8, 72, 12, 74], [1, 40]]  # "<bos>copy: 7", "<bos>1+5=", "<bos>x"


@pytest.fixture(scope="module")
def model(tiny_model_dir: str) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def make_prompts(**meta: Any) -> DataProto:
    """The three prompts left-padded to (3, 8) with a uid column."""
    input_ids = pad_sequences_left(PROMPTS, pad_value=PAD)
    mask = pad_sequences_left([[1] * len(p) for p in PROMPTS], pad_value=0)
    tensors = {"input_ids": input_ids, "attention_mask": mask, "position_ids": compute_position_ids(mask)}
    return DataProto.from_dict(tensors, non_tensors={"uid": ["a", "b", "c"]}, meta_info=meta)


def sampled(engine: HFRollout, **settings: Any) -> SamplingParams:
    """The engine's default settings with ``settings`` replaced (what a caller passes as ``sampling``)."""
    return dataclasses.replace(engine.defaults, **settings)


def teacher_forced(model: torch.nn.Module, out: DataProto, *, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of each response token, one forward on the full (B, T) sequence."""
    batch = out.batch
    assert batch is not None
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    prompt_len = batch["prompts"].shape[1]
    logits = logits[:, prompt_len - 1 : -1].float() / temperature  # (B, R, V): column t predicts response token t
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding without padding or KV cache: one full forward per new token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_is_a_rollout_engine(model: LlamaForCausalLM) -> None:
    assert isinstance(HFRollout(model, pad_token_id=PAD, eos_token_id=EOS), RolloutEngine)


def test_greedy_equals_step_by_step_argmax(model: LlamaForCausalLM) -> None:
    # eos_token_id=-1 never matches: every row runs R steps and can be compared token by token.
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=-1, response_length=R)
    out = engine.generate_sequences(make_prompts(), sampled(engine, do_sample=False))
    assert out.batch is not None
    for row, prompt in enumerate(PROMPTS):
        assert out.batch["responses"][row].tolist() == greedy_reference(model, prompt, R)
    assert out.batch["response_mask"].sum().item() == 3 * R
    assert set(out.meta_info) == {"timing"} and out.meta_info["timing"]["generate_sequences"] > 0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_log_probs_equal_the_teacher_forced_forward(tiny_model_dir: str, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    assert model.config._attn_implementation == attn
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=1)
    out = engine.generate_sequences(make_prompts(), sampled(engine, n=4, temperature=1.0))
    assert out.batch is not None
    mask = out.batch["response_mask"].float()
    expected = teacher_forced(model, out) * mask
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected, rtol=0, atol=1e-5)
    assert out.batch["rollout_log_probs"].dtype == torch.float32
    # the full sequence is prompts ++ responses, with the mask and positions of build_full_sequence
    torch.testing.assert_close(out.batch["input_ids"], torch.cat([out.batch["prompts"], out.batch["responses"]], 1))
    torch.testing.assert_close(out.batch["position_ids"], compute_position_ids(out.batch["attention_mask"]))


def test_raw_log_probs_ignore_temperature_and_processed_ones_follow_it(model: LlamaForCausalLM) -> None:
    raw = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=2, temperature=2.0)
    out = raw.generate_sequences(make_prompts())
    assert out.batch is not None
    mask = out.batch["response_mask"].float()
    torch.testing.assert_close(out.batch["rollout_log_probs"], teacher_forced(model, out) * mask, rtol=0, atol=1e-5)
    processed = HFRollout(
        model,
        pad_token_id=PAD,
        eos_token_id=EOS,
        response_length=R,
        seed=2,
        temperature=2.0,
        logprobs_mode="processed",
    )
    out = processed.generate_sequences(make_prompts())
    assert out.batch is not None
    expected = teacher_forced(model, out, temperature=2.0) * out.batch["response_mask"].float()
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected, rtol=0, atol=1e-5)
    # top_k=1 leaves one token: its processed probability is 1, log-prob 0
    out = processed.generate_sequences(make_prompts(), sampled(processed, top_k=1))
    assert out.batch is not None
    torch.testing.assert_close(out.batch["rollout_log_probs"], torch.zeros(3, R))


def test_eos_stops_a_row_and_pads_after_it(model: LlamaForCausalLM) -> None:
    free = greedy_reference(model, PROMPTS[0], R)
    eos = free[2]  # make row 0's third greedy token the EOS
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=[eos, 999], response_length=R)
    out = engine.generate_sequences(make_prompts(), sampled(engine, do_sample=False))
    assert out.batch is not None
    row = out.batch["responses"][0].tolist()
    assert row[:3] == free[:3] and row[3:] == [PAD] * (R - 3)
    first_eos = free.index(eos)  # equals 2 unless an earlier greedy token is also that id
    assert out.batch["response_mask"][0].tolist() == [1] * (first_eos + 1) + [0] * (R - first_eos - 1)
    assert (out.batch["rollout_log_probs"][0, first_eos + 1 :] == 0).all()
    prompt_len = out.batch["prompts"].shape[1]
    assert out.batch["attention_mask"][0, prompt_len:].tolist() == out.batch["response_mask"][0].tolist()


def test_all_rows_finished_early_still_pads_to_r(model: LlamaForCausalLM) -> None:
    firsts = {greedy_reference(model, p, 1)[0] for p in PROMPTS}
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=list(firsts), response_length=R)
    out = engine.generate_sequences(make_prompts(), sampled(engine, do_sample=False))
    assert out.batch is not None
    assert out.batch["responses"].shape == (3, R) and (out.batch["responses"][:, 1:] == PAD).all()
    assert out.batch["response_mask"].tolist() == [[1] + [0] * (R - 1)] * 3


def test_n_samples_are_adjacent_and_columns_repeat(model: LlamaForCausalLM) -> None:
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=4)
    out = engine.generate_sequences(make_prompts(), sampled(engine, n=3, response_length=5))
    assert out.batch is not None and len(out) == 9
    assert out.batch["responses"].shape == (9, 5) and out.batch["input_ids"].shape == (9, 8 + 5)
    assert out.batch["rollout_log_probs"].shape == (9, 5) and out.batch["response_mask"].shape == (9, 5)
    assert list(out.non_tensor_batch["uid"]) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    prompts = make_prompts().batch
    assert prompts is not None
    torch.testing.assert_close(out.batch["prompts"], prompts["input_ids"].repeat_interleave(3, dim=0))
    assert isinstance(out.non_tensor_batch["uid"], np.ndarray)


def test_top_k_one_equals_greedy(model: LlamaForCausalLM) -> None:
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=5)
    greedy = engine.generate_sequences(make_prompts(), sampled(engine, do_sample=False)).batch
    top1 = engine.generate_sequences(make_prompts(), sampled(engine, top_k=1, temperature=0.7)).batch
    assert greedy is not None and top1 is not None
    assert torch.equal(greedy["responses"], top1["responses"])
    torch.testing.assert_close(greedy["rollout_log_probs"], top1["rollout_log_probs"])


def test_same_seed_same_samples_and_training_mode_restored(model: LlamaForCausalLM) -> None:
    runs = [
        (e := HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=s)).generate_sequences(
            make_prompts(), sampled(e, n=2)
        )
        for s in (7, 7, 8)
    ]
    responses = [r.batch["responses"] for r in runs if r.batch is not None]
    assert torch.equal(responses[0], responses[1]) and not torch.equal(responses[0], responses[2])
    model.train()
    HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=2).generate_sequences(make_prompts())
    assert model.training
    model.eval()


def test_filter_logits_by_hand() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    inf = float("-inf")
    assert filter_logits(logits, top_k=2, top_p=1.0).tolist() == [[3.0, 2.0, inf, inf]]
    assert filter_logits(logits, top_k=-1, top_p=1.0).tolist() == logits.tolist()
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()  # sorted: 0.4, 0.3, 0.2, 0.1
    # top_p=0.65: 0.4 (mass before 0) and 0.3 (mass before 0.4) stay; 0.2 has 0.7 before it and goes
    kept = filter_logits(probs, top_k=0, top_p=0.65).isfinite().tolist()
    assert kept == [[False, True, False, True]]
    assert filter_logits(probs, top_k=0, top_p=0.01).isfinite().tolist() == [[False, True, False, False]]


def test_update_weights_copies_tensors_and_rejects_unknown_names(tiny_model_dir: str) -> None:
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    source = LlamaForCausalLM(target.config).eval()  # other random weights
    engine = HFRollout(target, pad_token_id=PAD, eos_token_id=-1, response_length=3)
    engine.update_weights(source.state_dict().items())
    out = engine.generate_sequences(make_prompts(), sampled(engine, do_sample=False)).batch
    assert out is not None
    assert out["responses"][1].tolist() == greedy_reference(source, PROMPTS[1], 3)
    with pytest.raises(ValueError, match="'nope', which the rollout module lacks; send HF names"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="send full"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])
    engine.release()
    engine.resume()


def test_bad_inputs_raise(model: LlamaForCausalLM) -> None:
    engine = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS)
    prompts = make_prompts()
    prompts.pop(batch_keys=["position_ids"])
    with pytest.raises(ValueError, match="needs tensor 'position_ids'"):
        engine.generate_sequences(prompts)
    with pytest.raises(ValueError, match="top_p=0.0 must be in"):
        sampled(engine, top_p=0.0)
    with pytest.raises(ValueError, match="meta_info key 'temperature' is unknown"):
        make_prompts(temperature=0.5)  # settings are arguments: the old meta_info channel is refused
    with pytest.raises(ValueError, match="logprobs_mode='exact'"):
        HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, logprobs_mode="exact")  # type: ignore[arg-type]


def test_sampling_params_validate_their_values() -> None:
    assert SamplingParams(n=2, eos_token_id=(2, 5), temperature=0.0).eos_ids == (2, 5)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(do_sample=False).greedy
    with pytest.raises(ValueError, match="response_length=0 must be >= 1"):
        SamplingParams(response_length=0)


def test_fsdp2_wrapped_module_generates_like_the_plain_one(tiny_model_dir: str, model: LlamaForCausalLM) -> None:
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        wrapped = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        mesh = init_device_mesh("cpu", (1,))
        for layer in wrapped.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(wrapped, mesh=mesh)
        engine = HFRollout(wrapped, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=3)
        # sync_stop=None: the engine all-reduces "all rows done" each step because the module is FSDP2
        out = engine.generate_sequences(make_prompts(), sampled(engine, n=2))
        ref = HFRollout(model, pad_token_id=PAD, eos_token_id=EOS, response_length=R, seed=3)
        expected = ref.generate_sequences(make_prompts(), sampled(ref, n=2))
        assert out.batch is not None and expected.batch is not None
        assert torch.equal(out.batch["responses"], expected.batch["responses"])
        torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"])
    finally:
        dist.destroy_process_group()
