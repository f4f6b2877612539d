"""The actor update of ``bench_vs_trl.py``'s workload, timed by phase without a profiler, against its matmul floor.

    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/update_breakdown.py --threads 2 [--dtype float32] [--profile]

One process, one rank (gloo world of 1), SmolLM2-135M-Instruct built by the platform's own path
(``build_fsdp_model``, ``fsdp.single_rank_plain``, bf16 CPU autocast, fp32 masters and AdamW). The mini-batch is the
bench's: 8 prompts x 4 samples (prompts of ~45 tokens, responses of 1-32 tokens), 4 micro-batches of 2 prompt groups,
shared-prompt packing, the fused log-prob. Per repetition it times the forwards, the backwards and the optimizer
step (``MiniBatchUpdate``, the worker's loop), for each variant in the same run, so the ratios hold on any host:

- ``keep-casts``: the platform's path (:func:`workers.fsdp.precision.keep_autocast_casts`: bf16 weight copies held
  over the mini-batch, gradients folded into the fp32 masters);
- ``per-forward``: autocast's own casts each forward (the path before 2026-12-05);
- ``embed-in-place`` (``--variants keep-casts,embed-in-place``): ``keep-casts`` with the input embedding's gradient
  added row by row into ``.grad`` (``index_add_``) instead of a dense vocabulary x hidden tensor per micro-batch,
  zero-filled and then added (the tied LM head of SmolLM2 shares that ``.grad``). Same sums in another fp32 order;
  a lever measured, not a platform path;
- ``grouped-attn`` (``--variants keep-casts,grouped-attn``): ``keep-casts`` with the shared-prompt row attended
  per prompt group instead of densely over the whole micro-batch (:func:`grouped_attention`); with ``--micro 16``
  or ``32`` it says whether larger micro-batches pay once attention stops growing with their square. The
  platform's path ``actor.share_prompt_attention=per_prompt``;
- ``compiled`` (``--variants keep-casts,compiled``): ``keep-casts`` with the elementwise work of every block fused by
  ``torch.compile`` (Inductor's C++ backend): RMSNorm as one kernel, the MLP's ``silu(gate) * up`` as one; the
  matmuls stay oneDNN's. A lever measured, not a platform path.

Then the floor, measured here: every GEMM of the update (forward, input gradient, weight gradient of each linear,
the LM head at the kept positions) run alone at the micro-batches' real shapes in bf16, and the FLOP bound at the
best bf16 rate this host reached on large shapes (``bench_vs_trl.matmul_peak``'s shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _batch(tok: Any, *, prompts: int, n: int, max_new: int, seed: int) -> dict[str, Any]:
    """A left-padded prompt + right-padded response batch of the bench's shape (random response lengths)."""
    import torch

    from bench.trl_workload import make_rows

    rng = random.Random(seed)
    prompt_ids = [
        tok(
            tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for row in make_rows(prompts, seed=seed)
    ]
    width = max(len(p) for p in prompt_ids)
    rows, masks, resp_masks = [], [], []
    for ids in prompt_ids:
        for _ in range(n):
            length = rng.randint(1, max_new)
            response = [rng.randrange(tok.vocab_size) for _ in range(length)] + [0] * (max_new - length)
            rows.append([0] * (width - len(ids)) + list(ids) + response)
            masks.append([0] * (width - len(ids)) + [1] * (len(ids) + length) + [0] * (max_new - length))
            resp_masks.append([1] * length + [0] * (max_new - length))
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(masks)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, -max_new:],
        "response_mask": torch.tensor(resp_masks, dtype=torch.float32),
    }


def _update_once(model: Any, optimizer: Any, batch: dict[str, Any], *, micro: int, keep: bool) -> dict[str, float]:
    """One mini-batch: forward + backward per micro-batch, then the clipped AdamW step; seconds per phase."""
    import contextlib

    from workers.actor.forward import response_log_probs
    from workers.fsdp import clipped_optimizer_step
    from workers.fsdp.precision import keep_autocast_casts

    rows, max_new = batch["input_ids"].shape[0], batch["responses"].shape[1]
    total_tokens = float(batch["response_mask"].sum())
    times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    with keep_autocast_casts(model) if keep else contextlib.nullcontext():
        for start in range(0, rows, micro):
            sl = slice(start, start + micro)
            t0 = time.perf_counter()
            log_probs, _ = response_log_probs(
                model,
                input_ids=batch["input_ids"][sl],
                attention_mask=batch["attention_mask"][sl],
                position_ids=batch["position_ids"][sl],
                response_length=max_new,
                share_prompts=True,
                use_remove_padding=True,
            )
            loss = -(log_probs * batch["response_mask"][sl]).sum() / total_tokens
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            times["forward"] += t1 - t0
            times["backward"] += t2 - t1
    t3 = time.perf_counter()
    result = clipped_optimizer_step(model, optimizer, None, max_norm=1.0)
    assert not result.skipped
    times["step"] = time.perf_counter() - t3
    times["total"] = sum(times.values())
    return times


def compile_elementwise(model: Any) -> Any:
    """Patches every RMSNorm and MLP of ``model`` to run their elementwise math through compiled functions.

    One compiled function per op (dynamic shapes), shared by all blocks, so 30 blocks compile once. Returns an undo
    callable that restores the modules' own forwards.
    """
    import types

    import torch
    import torch.nn.functional as F

    @torch.compile(dynamic=True)
    def rms_norm(x: Any, weight: Any, eps: float) -> Any:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    @torch.compile(dynamic=True)
    def silu_mul(gate: Any, up: Any) -> Any:
        return F.silu(gate) * up

    def norm_forward(self: Any, x: Any) -> Any:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def mlp_forward(self: Any, x: Any) -> Any:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(norm_forward, module)
            patched.append(module)
        elif name.endswith("MLP") and hasattr(module, "gate_proj"):
            module.forward = types.MethodType(mlp_forward, module)
            patched.append(module)

    def undo() -> None:
        for module in patched:
            del module.forward  # the instance attribute: the class's forward again

    return undo


def embedding_grad_in_place(model: Any) -> Any:
    """Patches the input embedding of ``model`` so its backward adds its rows into the weight's ``.grad`` in place.

    Returns an undo callable. The weight's other uses (a tied LM head) still reach ``.grad`` through autograd.
    """
    import types

    import torch
    import torch.nn.functional as F

    class _EmbeddingIntoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, ids: Any, weight: Any, padding_idx: int | None) -> Any:
            ctx.save_for_backward(ids)
            ctx.weight, ctx.padding_idx = weight, padding_idx
            return F.embedding(ids, weight, padding_idx)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            (ids,) = ctx.saved_tensors
            weight, ids = ctx.weight, ids.reshape(-1)
            rows = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
            if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
                keep = ids != ctx.padding_idx
                ids, rows = ids[keep], rows[keep]
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, ids, rows)
            return None, None, None

    embed = model.get_input_embeddings()

    def forward(self: Any, ids: Any) -> Any:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _EmbeddingIntoGrad.apply(ids, self.weight, self.padding_idx)
        return F.embedding(ids, self.weight, self.padding_idx)

    embed.forward = types.MethodType(forward, embed)

    def undo() -> None:
        del embed.forward

    return undo


def grouped_attention(model: Any) -> Any:
    """Switches the model to the platform's attention per prompt group (``actor.share_prompt_attention=per_prompt``,
    :mod:`workers.utils.prompt_group_attention`): each prompt group of the shared-prompt row attended on its own
    tokens instead of densely over the whole micro-batch. Returns an undo callable that switches back to sdpa."""
    from workers.utils.prompt_group_attention import enable_per_prompt_attention

    enable_per_prompt_attention(model)

    def undo() -> None:
        model.config._attn_implementation = "sdpa"

    return undo


def gemm_shapes(model_dir: str) -> dict[str, int]:
    """The model's shapes that ``gemm_floor`` reads: ``model_shapes`` plus the MLP width, vocabulary and KV width."""
    from bench.bench_vs_trl import model_shapes

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = model_shapes(model_dir)
    return shapes | {
        "inter": cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
        "kv_dim": cfg["num_key_value_heads"] * cfg.get("head_dim", shapes["hidden"] // cfg["num_attention_heads"]),
    }


def gemm_floor(
    shapes: dict[str, int], tokens: list[tuple[int, int]], *, reps: int = 3, dtype: str = "bfloat16"
) -> float:
    """Seconds of the update's GEMMs alone in ``dtype`` at the micro-batches' real shapes (best of ``reps``).

    ``tokens``: (forwarded tokens, kept LM-head positions) per micro-batch. Per linear (k x n) and micro-batch of m
    tokens: forward (m x k) @ (k x n), input gradient (m x n) @ (n x k), weight gradient (k x m) @ (m x n).
    """
    import torch

    h, inter, kv, vocab = shapes["hidden"], shapes["inter"], shapes["kv_dim"], shapes["vocab"]
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    total = 0.0
    for m, kept in tokens:
        work = []
        for k, n in {*linears, (h, vocab)}:  # one set of operands per distinct shape, made before the clock starts
            rows = kept if n == vocab else m
            count = 1 if n == vocab else shapes["layers"] * linears.count((k, n))
            x, w, g = (torch.randn(shape).to(getattr(torch, dtype)) for shape in ((rows, k), (k, n), (rows, n)))
            work.append((x, w, g, count))
        best = float("inf")
        for _ in range(reps + 1):  # the first round builds oneDNN's primitives
            start = time.perf_counter()
            for x, w, g, count in work:
                for _ in range(count):
                    x @ w, g @ w.t(), x.t() @ g
            best = min(best, time.perf_counter() - start)
        total += best
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=4, help="timed mini-batches per variant (after one warm-up)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the update's compute dtype (auto: bfloat16 where the CPU has it natively, else float32, as the bench)",
    )
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one mini-batch")
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch (8: 2 prompt groups, the bench's)")
    parser.add_argument(
        "--variants",
        default="per-forward,keep-casts",
        help="two of per-forward, keep-casts, compiled, embed-in-place, grouped-attn (interleaved)",
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    known = ["per-forward", "keep-casts", "compiled", "embed-in-place", "grouped-attn"]
    if not set(variants) <= set(known):
        sys.exit(f"--variants: {args.variants!r}; choose from {', '.join(known)}")
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from bench.bench_vs_trl import matmul_peak
    from rlhf_ops.config.precision import resolve_precision
    from rlhf_ops.config.schema import FSDPConfig, OptimConfig
    from rlhf_ops.models.resolve import resolve_model_path
    from workers.fsdp import build_device_mesh, build_fsdp_model, build_optimizer
    from workers.fsdp.precision import cpu_has_native_bf16, flush_denormals
    from workers.utils.shared_prompt import forwarded_lengths

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")
    flush_denormals(torch.device("cpu"))  # as the workers do, before the OpenMP pool starts
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = _batch(tok, prompts=8, n=4, max_new=32, seed=0)
    micro = args.micro  # rows per micro-batch (8: 2 prompt groups, as in the bench)
    fsdp = FSDPConfig(single_rank_plain=True)
    model = build_fsdp_model(
        model_dir,
        kind="causal_lm",
        mesh=build_device_mesh(1),
        cfg=fsdp,
        device="cpu",
        precision=resolve_precision(dtype, fsdp, trained=True, device="cpu"),
    )
    optimizer = build_optimizer(model, OptimConfig(lr=1e-7))
    results: dict[str, Any] = {"threads": args.threads, "micro": micro, "variants": {}}
    for variant in variants + variants:  # interleaved against drift
        keep = variant != "per-forward"
        patch = {
            "compiled": compile_elementwise,
            "embed-in-place": embedding_grad_in_place,
            "grouped-attn": grouped_attention,
        }.get(variant)
        undo = patch(model) if patch is not None else None
        start = time.perf_counter()
        _update_once(model, optimizer, batch, micro=micro, keep=keep)  # warm-up (oneDNN primitives, compilation)
        results.setdefault("warmup_s", {}).setdefault(variant, []).append(time.perf_counter() - start)
        runs = [_update_once(model, optimizer, batch, micro=micro, keep=keep) for _ in range(args.reps)]
        results["variants"].setdefault(variant, []).extend(runs)
        if undo is not None:
            undo()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _update_once(model, optimizer, batch, micro=micro, keep=variants[0] != "per-forward")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    summary = {
        name: {phase: statistics.median(r[phase] for r in runs) for phase in runs[0]}
        for name, runs in results["variants"].items()
    }
    shapes = gemm_shapes(model_dir)
    tokens = []
    for start in range(0, batch["input_ids"].shape[0], micro):
        sl = slice(start, start + micro)
        fwd = int(sum(forwarded_lengths(batch["input_ids"][sl], batch["attention_mask"][sl], response_length=32)))
        tokens.append((fwd, int(batch["response_mask"][sl].sum())))
    flops = sum(6 * shapes["body"] * m + 6 * shapes["head"] * k for m, k in tokens)
    peak = matmul_peak(args.threads)[dtype] * 1e9
    floor = gemm_floor(shapes, tokens, dtype=dtype)
    results |= {
        "summary": summary,
        "tokens": tokens,
        "gflop": flops / 1e9,
        "dtype": dtype,
        "peak_gflops": peak / 1e9,
        "flop_bound_s": flops / peak,
        "gemm_floor_s": floor,
    }
    print(f"micro-batches (forwarded tokens, kept positions): {tokens}; {flops / 1e9:.0f} GFLOP")
    print("| variant | forward (s) | backward (s) | AdamW step (s) | update (s) | x FLOP bound | x GEMM floor |")
    print("|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(
            f"| {name} | {s['forward']:.2f} | {s['backward']:.2f} | {s['step']:.3f} | {s['total']:.2f} | "
            f"{s['total'] / (flops / peak):.1f}x | {s['total'] / floor:.1f}x |"
        )
    print(
        f"{dtype} FLOP bound at {peak / 1e9:.0f} GFLOP/s: {flops / peak:.2f} s; the GEMMs alone at these shapes: "
        f"{floor:.2f} s ({flops / floor / 1e9:.0f} GFLOP/s)"
    )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
