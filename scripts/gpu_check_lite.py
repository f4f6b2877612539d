"""The workers' compute path on one GPU without Ray, vLLM, pydantic or MLflow: the check that fits a bare GPU box.

    python3 scripts/gpu_check_lite.py                          # CUDA, SmolLM2-135M shapes (random init)
    python3 scripts/gpu_check_lite.py --device cpu --dry-run   # gloo, tiny shapes: the CPU smoke test

One rank in a world of one (NCCL on CUDA, gloo on CPU) runs, on a Llama model built from SmolLM2-135M's
config with random weights (no download: a bare machine has neither the weights nor a network):

1. FSDP2 (``fully_shard`` per decoder layer, then the root) with bf16 compute and fp32 master weights and
   fp32 gradient reduction (``MixedPrecisionPolicy``), as ``workers/fsdp/wrap.py`` wraps the actor; Liger's
   kernels first when ``liger_kernel`` imports (CUDA only).
2. The rollout: ``workers.rollout.hf_rollout.HFRollout`` samples ``--samples`` responses per prompt from
   left-padded prompts of mixed lengths.
3. Log-probs of those responses through remove padding (``workers.utils.remove_padding``: one packed row, no
   mask) and the fused chunked log-prob (``rlhf_ops.algorithms.logprobs_and_entropy``), compared with a
   CPU fp32 forward of the same initial weights on a few rows (padded, no packing).
4. ``--steps`` GRPO updates (group advantages, the PPO clip loss, a low-variance KL to the initial policy,
   token-mean over the global token count, grad clip 1, AdamW) over micro-batches; then the same with LoRA
   (peft, rank ``--lora-rank``) on a fresh model.

Prints one JSON object: rollout tokens/s, update tokens/s and MFU against the dense bf16 peaks of the H200 and
the H100 (and the detected device's), the log-prob differences to the CPU reference, peak memory.

It imports only torch, transformers, peft and the project's torch-only modules, plus ``tensordict`` (the batch
container) and, optionally, ``liger_kernel``: both are small pure-Python wheels that ``scripts/gpu_check_lite.sh``
downloads here and installs there. ``tests/scripts/test_gpu_check_lite.py`` runs the dry run with pydantic, Ray,
vLLM and MLflow made unimportable.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a file

from rlhf_ops.algorithms import (  # noqa: E402
    compute_grpo_outcome_advantage,
    compute_policy_loss,
    kl_penalty,
    logprobs_and_entropy,
    masked_mean,
)
from rlhf_ops.protocol import DataProto  # noqa: E402
from rlhf_ops.sampling import SamplingParams  # noqa: E402
from workers.rollout.hf_rollout import HFRollout  # noqa: E402
from workers.utils.perf import flops_model, gpu_peak_flops, measured_cpu_peak_flops  # noqa: E402
from workers.utils.remove_padding import pack_sequences, scatter_response  # noqa: E402

# SmolLM2-135M-Instruct's config.json (the shapes only; the weights are random).
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
TINY: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
}
LOGP_TOLERANCE = 0.25  # nat: the largest log-prob gap to the CPU fp32 reference that passes


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Rows, lengths and micro-batching of one check."""

    prompts: int
    samples: int
    prompt_length: int  # P: the longest prompt; the others are shorter (left padding)
    new_tokens: int  # R
    micro_batch: int  # rows per update micro-batch
    steps: int
    ref_rows: int  # rows compared with the CPU reference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (2 layers, vocab 512), seconds on CPU")
    parser.add_argument("--prompts", type=int, default=None, help="default 64 (dry run: 4)")
    parser.add_argument("--samples", type=int, default=None, help="responses per prompt; default 8 (dry run: 2)")
    parser.add_argument("--prompt-length", type=int, default=None, help="default 128 (dry run: 12)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (dry run: 8)")
    parser.add_argument("--micro-batch", type=int, default=None, help="update rows per micro-batch; default 32")
    parser.add_argument("--steps", type=int, default=None, help="updates per phase; default 3 (dry run: 1)")
    parser.add_argument("--lora-rank", type=int, default=16, help="0 skips the LoRA phase")
    parser.add_argument("--no-liger", action="store_true", help="skip Liger's kernels even where they import")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def workload(args: argparse.Namespace) -> Workload:
    """The command line's sizes over the defaults of the full check or the dry run."""
    dry = args.dry_run

    def pick(value: int | None, full: int, tiny: int) -> int:
        return value if value is not None else (tiny if dry else full)

    return Workload(
        prompts=pick(args.prompts, 64, 4),
        samples=pick(args.samples, 8, 2),
        prompt_length=pick(args.prompt_length, 128, 12),
        new_tokens=pick(args.new_tokens, 256, 8),
        micro_batch=pick(args.micro_batch, 32, 4),
        steps=pick(args.steps, 3, 1),
        ref_rows=4,
    )


# ---------------------------------------------------------------------------------------------- setup
def init_process_group(device: torch.device) -> None:
    """A world of one: NCCL on CUDA, gloo on CPU, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, rank=0, world_size=1, **kwargs)


def build_model(shapes: dict[str, Any], *, seed: int) -> nn.Module:
    """A fp32 ``LlamaForCausalLM`` with these shapes and seeded random weights, on CPU (sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shapes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def wrap(model: nn.Module, device: torch.device, *, lora_rank: int, liger: bool) -> tuple[nn.Module, str]:
    """Liger (optional) -> LoRA (optional) -> device -> ``fully_shard`` per decoder layer, then the root.

    bf16 compute and fp32 master weights (the sharded parameters stay fp32; FSDP2 casts the gathered copy),
    gradients reduced in fp32: the actor's ``fsdp2`` precision mechanism. Returns (module, what Liger did: "on",
    "off", "absent" or the error that kept it off: a Liger that does not fit this transformers is reported, not
    fatal, so the rest of the check still runs).
    """
    applied = "off"
    if liger and device.type == "cuda":
        applied = "absent"
        if importlib.util.find_spec("liger_kernel") is not None:
            from workers.utils.liger import apply_liger

            try:
                apply_liger(model, device=device)
                applied = "on"
            except Exception as exc:  # noqa: BLE001 - reported in the JSON, the check goes on without it
                applied = f"failed: {type(exc).__name__}: {exc}"[:300]
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets))
    model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, applied


def make_prompts(work: Workload, vocab: int, device: torch.device, *, seed: int) -> DataProto:
    """Left-padded random prompts of lengths spread over [P/2, P]: (B, P) ids, mask and positions."""
    gen = torch.Generator().manual_seed(seed)
    b, p = work.prompts, work.prompt_length
    lengths = torch.randint(max(1, p // 2), p + 1, (b,), generator=gen)
    ids = torch.randint(3, vocab, (b, p), generator=gen)  # ids 0-2 are unk / bos / eos
    cols = torch.arange(p).unsqueeze(0)
    mask = (cols >= p - lengths.unsqueeze(1)).long()  # (B, P) left padding
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, 2))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    return DataProto.from_dict({k: v.to(device) for k, v in tensors.items()})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- compute
def packed_log_probs(module: nn.Module, t: Mapping[str, Tensor], *, response_length: int) -> Tensor:
    """(B, R) fp32 log-probs of the responses through remove padding: one packed row, positions restart per row.

    ``t`` holds ``input_ids``, ``attention_mask``, ``position_ids`` (B, T), the responses in the last R columns.
    """
    packed = pack_sequences(t["input_ids"], t["attention_mask"], t["position_ids"], response_length=response_length)
    out = module(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    logits = out.logits[0, packed.keep]  # (K, V) the positions predicting response tokens
    logp, _ = logprobs_and_entropy(logits, packed.labels)
    return scatter_response(logp, packed, batch_size=t["input_ids"].shape[0], response_length=response_length)


def cpu_reference_log_probs(reference: nn.Module, batch: DataProto, *, rows: int, response_length: int) -> Tensor:
    """(rows, R) fp32 log-probs of the first rows from the CPU copy of the initial weights, padded (no packing)."""
    assert batch.batch is not None
    t = {k: batch.batch[k][:rows].cpu() for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        logits = reference(**t, use_cache=False).logits[:, -response_length - 1 : -1]  # (rows, R, V)
        logp, _ = logprobs_and_entropy(logits.float(), t["input_ids"][:, -response_length:])
    return logp


def rewards(batch: DataProto) -> Tensor:
    """(B, R) token-level reward: the share of even ids in the response, on its last valid token (deterministic)."""
    assert batch.batch is not None
    responses, mask = batch.batch["responses"], batch.batch["response_mask"].float()
    score = ((responses % 2 == 0).float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros_like(mask)
    out[torch.arange(out.shape[0]), last] = score
    return out


def update(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: DataProto,
    *,
    old_logp: Tensor,
    ref_logp: Tensor,
    advantages: Tensor,
    work: Workload,
) -> dict[str, float]:
    """One GRPO mini-batch over micro-batches of ``work.micro_batch`` rows; the loss is a token mean over all."""
    assert batch.batch is not None
    mask = batch.batch["response_mask"].float()
    num_tokens = float(mask.sum())
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for start in range(0, mask.shape[0], work.micro_batch):
        rows = slice(start, start + work.micro_batch)
        micro = {k: batch.batch[k][rows] for k in ("input_ids", "attention_mask", "position_ids")}
        logp = packed_log_probs(module, micro, response_length=work.new_tokens)
        pg_loss, _ = compute_policy_loss(
            old_logp[rows],
            logp,
            advantages[rows],
            mask[rows],
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            global_num_tokens=num_tokens,
        )
        kl = (kl_penalty(logp, ref_logp[rows], "low_var_kl") * mask[rows]).sum() / num_tokens
        loss = pg_loss + 0.04 * kl
        loss.backward()
        total += float(loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return {
        "loss": total,
        "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
    }


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """CUDA: the caching allocator's peaks; CPU: the process's peak resident set (ru_maxrss)."""
    if device.type == "cuda":
        return {
            "max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_phase(
    name: str, shapes: dict[str, Any], work: Workload, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One model through rollout, packed log-probs vs the CPU reference, and ``work.steps`` updates."""
    lora = args.lora_rank if name == "lora" else 0
    base = build_model(shapes, seed=0)
    reference = copy.deepcopy(base).eval()  # CPU fp32 copy of the same initial weights
    module, liger = wrap(base, device, lora_rank=lora, liger=not args.no_liger)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, weight_decay=0.0)
    engine = HFRollout(module, pad_token_id=2, eos_token_id=2, response_length=work.new_tokens, seed=0)
    sampling = SamplingParams(n=work.samples, response_length=work.new_tokens, eos_token_id=2, pad_token_id=2)
    prompts = make_prompts(work, int(shapes["vocab_size"]), device, seed=1)
    fm = flops_model(module)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps: list[dict[str, float]] = []
    diff: dict[str, float] = {}
    for step in range(work.steps):
        sync(device)
        t0 = time.perf_counter()
        batch = engine.generate_sequences(prompts, sampling, step=step)
        sync(device)
        t1 = time.perf_counter()
        assert batch.batch is not None
        mask = batch.batch["response_mask"].float()
        with torch.no_grad():  # in micro-batches, as the workers' log-prob pass: the logits are (K, V)
            rows = batch.batch["input_ids"].shape[0]
            old_logp = torch.cat(
                [
                    packed_log_probs(
                        module,
                        {
                            k: batch.batch[k][i : i + work.micro_batch]
                            for k in ("input_ids", "attention_mask", "position_ids")
                        },
                        response_length=work.new_tokens,
                    )
                    for i in range(0, rows, work.micro_batch)
                ]
            )
        sync(device)
        t2 = time.perf_counter()
        if step == 0:  # same weights as the CPU copy only before the first update
            ref = cpu_reference_log_probs(reference, batch, rows=work.ref_rows, response_length=work.new_tokens)
            m = mask[: work.ref_rows].cpu()
            gap = (old_logp[: work.ref_rows].cpu() - ref).abs() * m
            rollout_gap = (old_logp - batch.batch["rollout_log_probs"]).abs() * mask
            diff = {
                "logp_vs_cpu_ref_max": float(gap.max()),
                "logp_vs_cpu_ref_mean": float(gap.sum() / m.sum().clamp(min=1)),
                "logp_vs_rollout_max": float(rollout_gap.max()),
                "logp_vs_rollout_mean": float(rollout_gap.sum() / mask.sum().clamp(min=1)),
            }
            ref_logp = old_logp  # the reference policy is the initial one
        index = np.repeat(np.arange(work.prompts), work.samples)
        advantages, _ = compute_grpo_outcome_advantage(rewards(batch), mask, index)
        stats = update(
            module, optimizer, batch, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, work=work
        )
        sync(device)
        t3 = time.perf_counter()
        seq_lens = batch.batch["attention_mask"].sum(-1).tolist()
        steps.append(
            {
                "generate_s": t1 - t0,
                "log_prob_s": t2 - t1,
                "update_s": t3 - t2,
                "update_flops": fm.train_flops(seq_lens),
                "tokens": float(sum(seq_lens)),
                "response_tokens": float(mask.sum()),
                "mean_logp": float(masked_mean(old_logp, mask)),
                **stats,
            }
        )
    return summarize(name, steps, diff, device, liger=liger, lora_rank=lora)


def summarize(
    name: str,
    steps: list[dict[str, float]],
    diff: dict[str, float],
    device: torch.device,
    *,
    liger: str,
    lora_rank: int,
) -> dict[str, Any]:
    """Medians over the steps after the first (the first pays compilation and allocator warm-up)."""
    timed = steps[1:] or steps
    med = {k: float(np.median([s[k] for s in timed])) for k in timed[0]}
    update_flops_s = med["update_flops"] / max(med["update_s"], 1e-9)
    peaks = {"H200": gpu_peak_flops("NVIDIA H200"), "H100": gpu_peak_flops("NVIDIA H100 80GB HBM3")}
    if device.type == "cuda":
        peaks["device"] = gpu_peak_flops(torch.cuda.get_device_name(device))
    else:
        peaks["device"] = measured_cpu_peak_flops(dtype=torch.bfloat16, num_threads=torch.get_num_threads())
    return {
        "phase": name,
        "liger": liger,
        "lora_rank": lora_rank,
        "steps": len(steps),
        "rollout_tokens_per_s": med["response_tokens"] / max(med["generate_s"], 1e-9),
        "log_prob_tokens_per_s": med["tokens"] / max(med["log_prob_s"], 1e-9),
        "update_tokens_per_s": med["tokens"] / max(med["update_s"], 1e-9),
        "update_tflops_per_s": update_flops_s / 1e12,
        **{f"update_mfu_vs_{k}_bf16": update_flops_s / v for k, v in peaks.items()},
        "seconds": {k: med[k] for k in ("generate_s", "log_prob_s", "update_s")},
        "loss": [s["loss"] for s in steps],
        "grad_norm": [s["grad_norm"] for s in steps],
        **diff,
        **peak_memory_gb(device),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here; run with --device cpu --dry-run for the CPU check.")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    work = workload(args)
    shapes = TINY if args.dry_run else SMOLLM2_135M
    init_process_group(device)
    try:
        phases = ["full"] + (["lora"] if args.lora_rank > 0 else [])
        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "dry_run": bool(args.dry_run),
            "workload": vars(work) | {"model": "tiny" if args.dry_run else "smollm2-135m-shaped (random init)"},
            "phases": [run_phase(p, shapes, work, device, args) for p in phases],
        }
    finally:
        dist.destroy_process_group()
    result["problems"] = problems(result["phases"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if result["problems"]:
        sys.exit("gpu_check_lite: " + "; ".join(result["problems"]))
    return result


def problems(phases: list[dict[str, Any]]) -> list[str]:
    """What makes the check fail: a non-finite loss or gradient, or log-probs off the CPU reference.

    bf16 compute against fp32 on the same weights: log-prob gaps of a few 1e-2 are bf16 rounding through the
    layers; 0.25 nat means a wrong mask, position or packing (those give gaps of whole nats).
    """
    found = []
    for phase in phases:
        name = phase["phase"]
        if not all(np.isfinite(phase["loss"])) or not all(np.isfinite(phase["grad_norm"])):
            found.append(f"{name}: non-finite loss or gradient norm ({phase['loss']}, {phase['grad_norm']})")
        if not phase["logp_vs_cpu_ref_max"] < LOGP_TOLERANCE:
            found.append(f"{name}: log-probs {phase['logp_vs_cpu_ref_max']:.3g} nat off the CPU reference")
    return found


if __name__ == "__main__":
    main()
