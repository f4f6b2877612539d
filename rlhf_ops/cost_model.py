"""Per-rank memory and seconds per step of a training config, predicted from shapes before anything runs.

Notation: P = model parameters, h = hidden size, I = intermediate size, L = layers, V = vocabulary, kv = key/value
heads x head_dim, S = ranks a role's parameters are sharded over, b = bytes of the compute dtype (2 bf16, 4 fp32),
t = tokens of one micro-batch, k = its response tokens (the positions that go through the LM head).

Memory of one rank (bytes), summed over what is resident at the update's peak:

- ``params``: the fp32 master weights, ``4 P / S`` (on the host with ``fsdp.param_offload``);
- ``compute_copy``: the bf16 weights a bf16 step computes with: FSDP2 gathers one decoder block (two with
  prefetch) plus the embedding, ``b (2 P_layer + V h)``; one plain rank keeps a cast of every weight, ``b P``;
- ``grads``: ``4 P_train / S`` (P_train: trained parameters; LoRA trains only its adapters);
- ``optimizer``: AdamW's two fp32 moments, ``8 P_train / S`` (on the host with ``fsdp.optimizer_offload``);
- ``activations``: what backward keeps of a micro-batch, per token and layer ``b (7 h + 3 kv + 4 I)`` elements'
  bytes (norm inputs and outputs, q k v and the rotated q k, the attention output, gate, up, SiLU and product),
  times ``t L``; with ``fsdp.activation_checkpointing`` only each block's input ``b h t L`` plus one block's
  full set ``b (7 h + 3 kv + 4 I) t``;
- ``logits``: the head's output over the response positions and its gradient, ``2 b k V``, plus the fused
  log-prob's fp32 chunk (16 MiB);
- ``reference``: the reference policy's weights, ``b_ref P / S``, when a KL to it is used;
- ``rollout``: CPU: vLLM's KV cache (``rollout.kv_cache_memory_bytes``), its own copy of the weights and its
  runtime (0.5 GiB), or the
  HF engine's KV cache ``2 L kv b_r (prompt + response) sequences``; GPU: vLLM holds
  ``rollout.gpu_memory_utilization`` of the card while it generates (what training keeps resident must fit
  beside it);
- ``runtime``: the process itself (Python, torch, transformers: 0.6 GiB on CPU; the CUDA context: 1 GiB on GPU).

Seconds of one step (a lower bound divided by a measured efficiency per stage):

- generation: prefill ``2 P_body T_prompt / F`` plus, per decode step, the larger of reading every weight once
  ``b_r P / B`` and its FLOPs ``2 P sequences / F`` (F: the matmul peak, B: memory bandwidth);
- the reference and old-log-prob forwards: ``2 P_body T_fwd + 2 V h T_resp`` FLOPs over F;
- the update: 3x a forward (4x with activation checkpointing: the forward runs again in backward);
- beside the matmuls, the forward and the update each pay a fixed time per token and block (norms, SiLU,
  residuals, the fp32 log-prob chunks, the optimizer's share), measured on 2-thread CPU ranks.

The efficiencies and elementwise terms are fitted on quiet runs of the reference CPU workload (SmolLM2-135M,
8 x 4 x 32, ``docs/benchmarks_vs_trl.md``); on GPUs they are assumptions, and the result is stated as a
prediction. This module imports nothing beyond the standard library: the driver and pre-flight use
it before torch is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30
LOGPROB_CHUNK_BYTES = 16 * 2**20  # rlhf_ops.algorithms.logits.CHUNK_BYTES
CPU_RUNTIME_BYTES = int(0.6 * GIB)  # one worker process: Python, torch, transformers (measured RSS before a model)
GPU_RUNTIME_BYTES = 1 * GIB  # the CUDA context and NCCL buffers of one rank
# vLLM's CPU engine in the worker process, beyond its weights and KV cache (its imports, scheduler, compiled
# graphs): fitted on the quiet reference runs (their peak RSS was 0.4-0.8 GiB above the other terms).
VLLM_CPU_RUNTIME_BYTES = int(0.5 * GIB)


@dataclass(frozen=True, kw_only=True)
class ModelShapes:
    """The sizes of a decoder-only transformer, as its ``config.json`` states them."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShapes:
        """From an HF ``config.json`` (a VLM's ``text_config`` when it has one).

        Raises:
            ValueError: a size the model needs is missing (named).
        """
        text = config.get("text_config") or config
        missing = [
            k
            for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
            if k not in text
        ]
        if missing:
            raise ValueError(f"config.json has no {', '.join(missing)}: the cost model needs the model's sizes.")
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            layers=int(text["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab=int(text["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )

    @property
    def layer_params(self) -> int:
        """Weights of one decoder block: q, o (h x heads*hd), k, v (h x kv*hd), gate/up/down (3 h I), 2 norms."""
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def body_params(self) -> int:
        """The decoder blocks' weights: the matmuls every token goes through."""
        return self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        """The LM head's matmul (V h), whether or not it shares the embedding's storage."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Stored parameters: embedding, blocks, final norm, and the head unless tied."""
        head = 0 if self.tied_embeddings else self.head_params
        return self.vocab * self.hidden + self.body_params + self.hidden + head

    def lora_params(self, rank: int) -> int:
        """Adapter weights of LoRA ``rank`` on the seven linears of every block: ``r (in + out)`` each."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (h + q) * 2 + (h + kv) * 2 + (h + i) * 3
        return self.layers * rank * per_layer

    @property
    def activation_elements_per_token_layer(self) -> int:
        """Elements backward keeps per token per block (see the module docstring)."""
        return 7 * self.hidden + 3 * self.kv_heads * self.head_dim + 4 * self.intermediate


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """The work of one step on one rank, from the batch plan and the expected lengths."""

    prompts: int  # prompts per step on this rank's rollout share
    samples: int  # rollout.n
    prompt_len: float  # mean prompt tokens
    response_len: float  # mean response tokens (at most rollout.max_new_tokens)
    max_seq_len: int  # padded row length (max prompt + max response)
    update_micro_batch: int  # rows per update micro-batch
    log_prob_micro_batch: int
    optimizer_steps: int  # mini-batches x epochs
    remove_padding: bool
    share_prompt: bool  # each prompt forwarded once for its samples
    max_micro_tokens: float | None = None  # dynamic batch size: the update micro-batch's token budget

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def forward_tokens(self) -> float:
        """Tokens one forward over the step's rows runs on (each shared prompt once; padding without packing)."""
        if not self.remove_padding:
            return float(self.sequences * self.max_seq_len)
        prompt_tokens = self.prompts * self.prompt_len * (1 if self.share_prompt else self.samples)
        return prompt_tokens + self.sequences * self.response_len

    def micro_tokens(self, rows: int) -> float:
        """Tokens of one micro-batch of ``rows`` rows (at most the token budget, with dynamic batch size)."""
        tokens = self.forward_tokens * min(rows, self.sequences) / max(self.sequences, 1)
        if self.max_micro_tokens is not None:
            tokens = min(self.forward_tokens, self.max_micro_tokens)
        return tokens

    def micro_response_tokens(self, rows: int) -> float:
        """Response positions (the LM head's rows) of that micro-batch: its tokens' response share."""
        return self.micro_tokens(rows) * self.sequences * self.response_len / max(self.forward_tokens, 1.0)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes and placement choices that change memory."""

    compute_bytes: int = 4  # 2: bf16 compute (autocast on CPU, FSDP2 param_dtype on GPU)
    ref_bytes: int = 4
    shard: int = 1  # ranks the parameters are sharded over (the FSDP shard size)
    plain_single_rank: bool = False  # fsdp.single_rank_plain: no FSDP2 gathers, casts of every weight
    param_offload: bool = False
    optimizer_offload: bool = False
    activation_checkpointing: bool = False
    lora_rank: int = 0
    use_reference: bool = True


@dataclass(frozen=True, kw_only=True)
class RolloutMemory:
    """What the rollout engine holds on a rank."""

    engine: str  # "hf" or "vllm"
    device: str  # "cpu" or "cuda"
    dtype_bytes: int = 4
    kv_cache_bytes: int | None = None  # vLLM on CPU
    gpu_memory_utilization: float = 0.5  # vLLM on GPU


def memory_terms(
    shapes: ModelShapes, step: StepShape, precision: Precision, rollout: RolloutMemory
) -> dict[str, float]:
    """Per-rank memory by term, in bytes, at the update's peak (see the module docstring for each term)."""
    p, s = shapes.params, max(precision.shard, 1)
    trained = shapes.lora_params(precision.lora_rank) if precision.lora_rank else p
    b = precision.compute_bytes
    terms: dict[str, float] = {}
    terms["params"] = 0.0 if precision.param_offload else 4.0 * p / s
    if b < 4:
        if precision.plain_single_rank or s == 1:
            terms["compute_copy"] = float(b * p)
        else:
            terms["compute_copy"] = float(b * (2 * shapes.layer_params + shapes.vocab * shapes.hidden))
    terms["grads"] = 4.0 * trained / s
    terms["optimizer"] = 0.0 if precision.optimizer_offload else 8.0 * trained / s
    t = step.micro_tokens(step.update_micro_batch)
    per_token_layer = b * shapes.activation_elements_per_token_layer
    if precision.activation_checkpointing:
        terms["activations"] = b * shapes.hidden * t * shapes.layers + per_token_layer * t
    else:
        terms["activations"] = per_token_layer * t * shapes.layers
    k = step.micro_response_tokens(step.update_micro_batch)
    terms["logits"] = 2.0 * b * k * shapes.vocab + LOGPROB_CHUNK_BYTES
    if precision.use_reference:
        terms["reference"] = float(precision.ref_bytes * p / s)
    terms["rollout"] = rollout_bytes(shapes, step, rollout)
    terms["runtime"] = float(GPU_RUNTIME_BYTES if rollout.device == "cuda" else CPU_RUNTIME_BYTES)
    return terms


def rollout_bytes(shapes: ModelShapes, step: StepShape, rollout: RolloutMemory) -> float:
    """What the engine holds beside training: see ``rollout`` in the module docstring (GPU vLLM: 0 here, its
    share of the card is checked by :func:`gpu_rollout_fits`)."""
    kv_per_token = 2 * shapes.layers * shapes.kv_heads * shapes.head_dim * rollout.dtype_bytes
    tokens = step.sequences * (step.prompt_len + step.response_len)
    if rollout.engine == "vllm":
        if rollout.device == "cuda":
            return 0.0
        kv = rollout.kv_cache_bytes if rollout.kv_cache_bytes is not None else kv_per_token * tokens
        return float(kv + rollout.dtype_bytes * shapes.params + VLLM_CPU_RUNTIME_BYTES)
    return float(kv_per_token * tokens)


def resident_between_updates(terms: Mapping[str, float]) -> float:
    """What stays on the GPU while vLLM generates: weights, optimizer, reference, runtime (no activations)."""
    return sum(terms.get(k, 0.0) for k in ("params", "optimizer", "reference", "runtime"))


def gpu_rollout_fits(terms: Mapping[str, float], *, utilization: float, gpu_bytes: float) -> bool:
    """Whether vLLM's share of the card fits beside what training keeps resident while it generates."""
    return resident_between_updates(terms) + utilization * gpu_bytes <= gpu_bytes


# ---------------------------------------------------------------------------------------------- time
@dataclass(frozen=True, kw_only=True)
class Peaks:
    """What one rank's device can do: matmul FLOP/s in the compute dtype and memory bandwidth in bytes/s."""

    name: str
    flops: float
    rollout_flops: float  # in the rollout engine's dtype
    bandwidth: float
    memory_bytes: float  # per rank: GPU memory, or the host's RAM shared by the node's ranks
    measured: bool  # False: from the GPU table (a prediction), True: measured on this host
    fp32_flops: float | None = None  # fp32 matmul FLOP/s (reported); None: ``flops``


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """Dense bf16 tensor-core FLOP/s, HBM bandwidth and memory of one card (vendor data sheets)."""

    flops: float
    bandwidth: float
    memory_gib: float


GPU_TABLE: dict[str, GPUSpec] = {
    "H200": GPUSpec(flops=989e12, bandwidth=4.8e12, memory_gib=141),
    "H100": GPUSpec(flops=989e12, bandwidth=3.35e12, memory_gib=80),
    "H100-PCIE": GPUSpec(flops=756e12, bandwidth=2.0e12, memory_gib=80),
    "A100-80GB": GPUSpec(flops=312e12, bandwidth=2.0e12, memory_gib=80),
    "A100-40GB": GPUSpec(flops=312e12, bandwidth=1.56e12, memory_gib=40),
    "L40S": GPUSpec(flops=362e12, bandwidth=0.864e12, memory_gib=48),
    "A10G": GPUSpec(flops=125e12, bandwidth=0.6e12, memory_gib=24),
    "L4": GPUSpec(flops=121e12, bandwidth=0.3e12, memory_gib=24),
}


def gpu_peaks(name: str) -> Peaks:
    """The table's peaks of GPU ``name`` (a key of :data:`GPU_TABLE`, any case).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    key = name.upper()
    if key not in GPU_TABLE:
        raise ValueError(f"unknown GPU {name!r}; the cost model knows {', '.join(GPU_TABLE)}.")
    spec = GPU_TABLE[key]
    return Peaks(
        name=key,
        flops=spec.flops,
        rollout_flops=spec.flops,
        bandwidth=spec.bandwidth,
        memory_bytes=spec.memory_gib * GIB,
        measured=False,
    )


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fraction of each stage's matmul bound reached, and the work beside the matmuls (see the module docstring)."""

    generation: float
    forward: float
    update: float
    forward_elementwise_s: float = 0.0  # seconds per token per block beside the matmuls (forward)
    update_elementwise_s: float = 0.0  # the same for forward + backward + the optimizer's share
    overhead_s: float = 0.0  # per step: the controller, Ray calls, reward


# Fitted on this repository's quiet runs of the reference CPU workload (SmolLM2-135M, 8 prompts x 4 samples x
# 32 tokens, vLLM rollout in fp32, one plain rank of 2 threads on the AVX512-BF16 EPYC, bench matmul peaks fp32
# 191 / bf16 801 GFLOP/s; docs/benchmarks_vs_trl.md, 2026-12-04): the bf16 and fp32 rows give two equations per
# stage, solved for the matmul fraction and the elementwise seconds (forward 1.06 / 2.07 s, update 4.22 / 8.39 s;
# generation 3.16 s against its bound of 1.33 s). The elementwise work (vector ops, not matmuls) did not follow the
# matmul peak to the AMX Xeon, so it is kept in seconds for 2 threads rather than scaled by a peak.
CPU_EFFICIENCY = Efficiency(
    generation=0.42,
    forward=1.0,
    update=0.73,
    forward_elementwise_s=24e-6,
    update_elementwise_s=95e-6,
    overhead_s=0.25,
)
# Assumptions, not measurements: a well-fed update at 40 % MFU, decode at half the HBM bandwidth.
GPU_EFFICIENCY = Efficiency(generation=0.5, forward=0.5, update=0.4, overhead_s=1.0)


def stage_seconds(
    shapes: ModelShapes,
    step: StepShape,
    peaks: Peaks,
    efficiency: Efficiency,
    *,
    rollout_dtype_bytes: int,
    old_log_prob: bool,
    use_reference: bool,
    activation_checkpointing: bool,
    lora: bool = False,
) -> dict[str, float]:
    """Predicted seconds of each stage of one step on one rank (see the module docstring for each bound)."""
    body, head = shapes.body_params, shapes.head_params
    prompt_tokens = step.prompts * step.prompt_len
    prefill = 2.0 * body * prompt_tokens / peaks.rollout_flops
    weight_read = rollout_dtype_bytes * (body + head) / peaks.bandwidth
    decode_flops = 2.0 * (body + head) * step.sequences / peaks.rollout_flops
    decode = step.response_len * max(weight_read, decode_flops)
    forward_flops = 2.0 * body * step.forward_tokens + 2.0 * head * step.sequences * step.response_len
    forward = forward_flops / peaks.flops
    token_layers = step.forward_tokens * shapes.layers
    forward_s = forward / efficiency.forward + efficiency.forward_elementwise_s * token_layers
    # A frozen base (LoRA) skips its weight gradients: 2x a forward instead of 3x.
    update_factor = (2.0 if lora else 3.0) + (1.0 if activation_checkpointing else 0.0)
    out = {"gen": (prefill + decode) / efficiency.generation}
    if old_log_prob:
        out["old_log_prob"] = forward_s
    if use_reference:
        out["ref"] = forward_s
    out["update_actor"] = update_factor * forward / efficiency.update + efficiency.update_elementwise_s * token_layers
    out["overhead"] = efficiency.overhead_s
    return out


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Per-rank memory by term and seconds by stage, with what they were predicted against."""

    memory: dict[str, float]
    seconds: dict[str, float]
    peaks: Peaks
    ranks_per_memory: int  # ranks sharing ``peaks.memory_bytes`` (a node's ranks on CPU, 1 on GPU)
    notes: list[str] = field(default_factory=list)

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    def summary(self) -> str:
        """One line: per-rank memory against the budget, s/step and its stages."""
        budget = self.peaks.memory_bytes / max(self.ranks_per_memory, 1)
        kind = "measured on this host" if self.peaks.measured else f"from the {self.peaks.name} table: a prediction"
        memory = f"cost model ({kind}): {self.memory_bytes / GIB:.2f} GiB per rank of {budget / GIB:.1f} GiB"
        if not self.seconds:
            return "; ".join([memory, *self.notes])
        stages = ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items())
        return "; ".join([f"{memory}, {self.step_seconds:.1f} s/step ({stages})", *self.notes])

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_gib": {k: v / GIB for k, v in self.memory.items()},
            "memory_gib_total": self.memory_bytes / GIB,
            "budget_gib_per_rank": self.peaks.memory_bytes / max(self.ranks_per_memory, 1) / GIB,
            "seconds": self.seconds,
            "s_per_step": self.step_seconds,
            "peaks": {
                "name": self.peaks.name,
                "tflops": self.peaks.flops / 1e12,
                "rollout_tflops": self.peaks.rollout_flops / 1e12,
                "bandwidth_gb_s": self.peaks.bandwidth / 1e9,
                "measured": self.peaks.measured,
            },
            "notes": self.notes,
        }
