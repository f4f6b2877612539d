"""The cost model's memory and time terms, worked out by hand on a toy shape.

Toy model: L=2 layers, h=8, I=16, 2 heads of head_dim 4 (q: 8 wide), 1 kv head (kv: 4 wide), V=32, tied.
  block: q, o 2*8*8 = 128; k, v 2*8*4 = 64; MLP 3*8*16 = 384; norms 2*8 = 16   -> 592
  body 2*592 = 1184; head V*h = 256; stored params 256 (embedding) + 1184 + 8 (final norm) = 1448
Toy step: 2 prompts x 2 samples, prompts of 10 tokens, responses of 5, packed, each prompt forwarded once:
  forward tokens 2*10 + 4*5 = 40; a micro-batch of 2 rows holds half of them, 20, and 2*5 = 10 response tokens.
"""

from __future__ import annotations

import math

import pytest

from rlhf_ops.cost_model import (
    CPU_RUNTIME_BYTES,
    LOGPROB_CHUNK_BYTES,
    VLLM_CPU_RUNTIME_BYTES,
    Efficiency,
    ModelShapes,
    Peaks,
    Precision,
    RolloutMemory,
    StepShape,
    gpu_peaks,
    gpu_rollout_fits,
    memory_terms,
    stage_seconds,
)

SHAPES = ModelShapes(
    layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=32, tied_embeddings=True
)
STEP = StepShape(
    prompts=2,
    samples=2,
    prompt_len=10,
    response_len=5,
    max_seq_len=20,
    update_micro_batch=2,
    log_prob_micro_batch=2,
    optimizer_steps=1,
    remove_padding=True,
    share_prompt=True,
)
HF_CPU = RolloutMemory(engine="hf", device="cpu")


def test_parameter_counts() -> None:
    assert SHAPES.layer_params == 592
    assert SHAPES.body_params == 1184 and SHAPES.head_params == 256
    assert SHAPES.params == 1448
    untied = ModelShapes(**{**SHAPES.__dict__, "tied_embeddings": False})
    assert untied.params == 1448 + 256
    # LoRA r=2 per block: q, o (8+8)*2; k, v (8+4)*2; gate, up, down (8+16)*3 = 128, times r=2 and 2 blocks.
    assert SHAPES.lora_params(2) == 512
    # 7h + 3kv + 4I = 56 + 12 + 64
    assert SHAPES.activation_elements_per_token_layer == 132


def test_shapes_from_config_json() -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 32,
        "tie_word_embeddings": True,
    }
    assert ModelShapes.from_config(config) == SHAPES
    with pytest.raises(ValueError, match="vocab_size"):
        ModelShapes.from_config({k: v for k, v in config.items() if k != "vocab_size"})


def test_step_tokens() -> None:
    assert STEP.sequences == 4 and STEP.forward_tokens == 40 and STEP.micro_tokens(2) == 20
    unshared = StepShape(**{**STEP.__dict__, "share_prompt": False})
    assert unshared.forward_tokens == 4 * 10 + 4 * 5
    padded = StepShape(**{**STEP.__dict__, "remove_padding": False})
    assert padded.forward_tokens == 4 * 20
    assert STEP.micro_response_tokens(2) == 10  # 20 tokens x (20 response of 40 forwarded)
    budget = StepShape(**{**STEP.__dict__, "max_micro_tokens": 16.0})  # dynamic batch size: a 16-token budget
    assert budget.micro_tokens(2) == 16 and budget.micro_response_tokens(2) == 8


def test_fp32_memory_terms() -> None:
    terms = memory_terms(SHAPES, STEP, Precision(), HF_CPU)
    assert terms == {
        "params": 4 * 1448,  # fp32 master weights
        "grads": 4 * 1448,
        "optimizer": 8 * 1448,  # two AdamW moments
        "activations": 4 * 132 * 20 * 2,  # bytes x elements x tokens x layers = 21120
        "logits": 2 * 4 * 10 * 32 + LOGPROB_CHUNK_BYTES,  # logits and their gradient over 10 response positions
        "reference": 4 * 1448,
        "rollout": 2 * 2 * 1 * 4 * 4 * 4 * 15,  # K and V x L x kv x 4 bytes per token, 4 rows of 15 tokens: 3840
        "runtime": CPU_RUNTIME_BYTES,
    }


def test_checkpointing_keeps_block_inputs_and_one_block() -> None:
    terms = memory_terms(SHAPES, STEP, Precision(activation_checkpointing=True), HF_CPU)
    assert terms["activations"] == 4 * 8 * 20 * 2 + 4 * 132 * 20  # 1280 + 10560


def test_bf16_compute_copy_plain_and_sharded() -> None:
    plain = memory_terms(SHAPES, STEP, Precision(compute_bytes=2), HF_CPU)
    assert plain["compute_copy"] == 2 * 1448  # a bf16 cast of every weight
    assert plain["activations"] == 2 * 132 * 20 * 2
    sharded = memory_terms(SHAPES, STEP, Precision(compute_bytes=2, shard=2), HF_CPU)
    assert sharded["compute_copy"] == 2 * (2 * 592 + 256)  # two gathered blocks and the embedding
    assert sharded["params"] == 4 * 1448 / 2 and sharded["optimizer"] == 8 * 1448 / 2


def test_lora_offload_and_vllm_terms() -> None:
    lora = memory_terms(SHAPES, STEP, Precision(lora_rank=2, use_reference=False), HF_CPU)
    assert lora["grads"] == 4 * 512 and lora["optimizer"] == 8 * 512 and "reference" not in lora
    offload = memory_terms(SHAPES, STEP, Precision(param_offload=True, optimizer_offload=True), HF_CPU)
    assert offload["params"] == 0 and offload["optimizer"] == 0
    vllm_cpu = memory_terms(SHAPES, STEP, Precision(), RolloutMemory(engine="vllm", device="cpu", kv_cache_bytes=1000))
    assert vllm_cpu["rollout"] == 1000 + 4 * 1448 + VLLM_CPU_RUNTIME_BYTES  # KV cache, fp32 weights, runtime


def test_gpu_rollout_share() -> None:
    h100 = gpu_peaks("h100")
    assert h100.memory_bytes == 80 * 2**30 and not h100.measured
    # 40 GiB resident (params + optimizer + runtime) beside vLLM's 0.5 of 80 GiB fits exactly; 0.6 does not.
    terms = {"params": 13 * 2**30, "optimizer": 26 * 2**30, "runtime": 2**30, "activations": 50 * 2**30}
    assert gpu_rollout_fits(terms, utilization=0.5, gpu_bytes=h100.memory_bytes)
    assert not gpu_rollout_fits(terms, utilization=0.6, gpu_bytes=h100.memory_bytes)
    with pytest.raises(ValueError, match="H200"):
        gpu_peaks("B300")


def test_stage_seconds_by_hand() -> None:
    peaks = Peaks(name="toy", flops=1e9, rollout_flops=1e9, bandwidth=1e9, memory_bytes=1e9, measured=True)
    ideal = Efficiency(generation=1.0, forward=1.0, update=1.0, overhead_s=0.0)
    seconds = stage_seconds(
        SHAPES,
        STEP,
        peaks,
        ideal,
        rollout_dtype_bytes=4,
        old_log_prob=False,
        use_reference=True,
        activation_checkpointing=False,
    )
    # prefill 2 * 1184 * 20 prompt tokens = 47,360 FLOPs; each of 5 decode steps: max(read 4 * 1440 = 5,760 B,
    # 2 * 1440 * 4 rows = 11,520 FLOPs) -> 57,600; generation 104,960 / 1e9.
    assert math.isclose(seconds["gen"], 104_960 / 1e9)
    # forward: 2 * 1184 * 40 tokens + 2 * 256 * 20 response tokens = 94,720 + 10,240 = 104,960 FLOPs
    assert math.isclose(seconds["ref"], 104_960 / 1e9)
    assert math.isclose(seconds["update_actor"], 3 * 104_960 / 1e9)
    assert "old_log_prob" not in seconds and seconds["overhead"] == 0.0
    recompute = stage_seconds(
        SHAPES,
        STEP,
        peaks,
        ideal,
        rollout_dtype_bytes=4,
        old_log_prob=True,
        use_reference=False,
        activation_checkpointing=True,
    )
    assert math.isclose(recompute["update_actor"], 4 * 104_960 / 1e9) and "ref" not in recompute
    assert math.isclose(recompute["old_log_prob"], 104_960 / 1e9)


def test_elementwise_terms_scale_with_tokens_and_layers() -> None:
    peaks = Peaks(name="toy", flops=1e9, rollout_flops=1e9, bandwidth=1e9, memory_bytes=1e9, measured=True)
    work = Efficiency(generation=1.0, forward=1.0, update=1.0, forward_elementwise_s=1e-6, update_elementwise_s=4e-6)
    seconds = stage_seconds(
        SHAPES,
        STEP,
        peaks,
        work,
        rollout_dtype_bytes=4,
        old_log_prob=False,
        use_reference=True,
        activation_checkpointing=False,
    )
    # 40 forward tokens x 2 blocks = 80 token-blocks: 80 us beside the forward's 104,960 FLOPs / 1e9
    assert math.isclose(seconds["ref"], 104_960 / 1e9 + 80e-6)
    assert math.isclose(seconds["update_actor"], 3 * 104_960 / 1e9 + 320e-6)
