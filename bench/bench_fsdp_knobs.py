"""Benchmark: what each FSDP knob does on 2 CPU ranks (gloo): prefetch, wrap policy, shard-group size.

Run (2 processes, one torch thread each)::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_fsdp_knobs.py      # [--steps 3] [--seq 128] [--batch 2]
                                                                       # [--hidden 512] [--layers 8]

Model: a random Llama (default hidden 512, 8 layers, 8 heads / 4 kv heads, MLP 1408, vocab 8192, untied), the
same init on both ranks. Each variant: ``apply_fsdp2`` with its ``FSDPConfig``, AdamW, then
``--steps`` timed training steps (forward + backward + optimizer step on ``--batch`` x ``--seq`` random tokens per
rank) after one warm-up. Reported per variant (the baseline is the default config, measured in the same run):
FSDP units, parameter bytes held by rank 0 between steps (its shards), median step seconds (max over ranks),
and the peak RSS growth during the timed steps (max over ranks, sampled every 5 ms). Gloo runs collectives
synchronously on the CPU threads, so prefetch can reorder communication but cannot overlap it with compute here:
on GPUs (NCCL on its own streams) the same knobs trade memory for overlap.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rlhf_ops.config.schema import FSDPConfig, FSDPWrapPolicyConfig  # noqa: E402

WORLD = 2
VARIANTS: dict[str, FSDPConfig] = {
    "default (blocks, implicit prefetch)": FSDPConfig(),
    "forward_prefetch=1": FSDPConfig(forward_prefetch=1),
    "forward_prefetch=2": FSDPConfig(forward_prefetch=2),
    "backward_prefetch=2": FSDPConfig(backward_prefetch=2),
    "wrap: LlamaAttention+LlamaMLP": FSDPConfig(
        wrap_policy=FSDPWrapPolicyConfig(transformer_layer_cls_to_wrap=["LlamaAttention", "LlamaMLP"])
    ),
    "wrap: min_num_params=1M": FSDPConfig(wrap_policy=FSDPWrapPolicyConfig(min_num_params=1_000_000)),
    "wrap: root only (min_num_params=1e9)": FSDPConfig(wrap_policy=FSDPWrapPolicyConfig(min_num_params=10**9)),
    "fsdp_size=1 (2 replicas, no sharding)": FSDPConfig(hsdp_replicate_size=2),
    "reshard_after_forward=false": FSDPConfig(reshard_after_forward=False),
}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=args.hidden * 11 // 4,
        vocab_size=8192,
        tie_word_embeddings=False,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _run_variant(rank: int, name: str, cfg: FSDPConfig, args: argparse.Namespace) -> dict[str, float]:
    from torch.distributed.fsdp import FSDPModule

    from workers.fsdp import apply_fsdp2, build_device_mesh
    from workers.utils.profiling import _RSSPeak

    replicate = cfg.hsdp_replicate_size
    mesh = build_device_mesh(WORLD, replicate_size=replicate)
    model = apply_fsdp2(_model(args), mesh, cfg)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 8192, (args.batch, args.seq), generator=gen)

    def step() -> None:
        logits = model(input_ids=tokens).logits
        logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, optimizer state
    dist.barrier()
    sampler = _RSSPeak()
    start_rss = sampler.peak
    sampler.start()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = sampler.stop()
    return {
        "units": float(units),
        "param_mib": local_bytes / 2**20,
        "step_s": statistics.median(times),
        "rss_growth_mib": (peak - start_rss) / 2**20,
        "name": name,  # type: ignore[dict-item]
    }


def _worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        rows = []
        for name, cfg in VARIANTS.items():
            row = _run_variant(rank, name, cfg, args)
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, row)
            rows.append(gathered)
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (MLP = 11/4 of it)")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    base = max(r["step_s"] for r in rows[0])
    print(
        f"2 gloo ranks, Llama hidden {args.hidden} x {args.layers} layers, batch {args.batch} x seq {args.seq} per "
        f"rank, median of {args.steps} steps"
    )
    print(
        f"{'variant':40s} {'units':>5s} {'rank0 params MiB':>16s} {'step s':>7s} {'vs default':>10s} {'RSS +MiB':>9s}"
    )
    for per_rank in rows:
        step_s = max(r["step_s"] for r in per_rank)
        growth = max(r["rss_growth_mib"] for r in per_rank)
        r0 = per_rank[0]
        print(
            f"{r0['name']:40s} {int(r0['units']):5d} {r0['param_mib']:16.1f} {step_s:7.3f} "
            f"{step_s / base:9.2f}x {growth:9.1f}"
        )


if __name__ == "__main__":
    main()
