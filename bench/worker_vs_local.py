"""The actor update inside a Ray actor against the same loop in the driver, one run, interleaved.

    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/worker_vs_local.py --reps 2

Both sides build SmolLM2-135M-Instruct by the platform's path (``bench/update_breakdown.py``: plain layout,
shared-prompt packing, the fused log-prob; bf16 autocast where the CPU has native bf16, else fp32) and time the
same mini-batch update, plus three micro-ops the worker's profile showed slow (the LM head's weight-gradient GEMM,
``exp`` over a log-softmax chunk, a multiply over denormals). The actor is placed as the platform places a rank:
``num_cpus`` = the threads, the workers' runtime env (``workers.entrypoints.train.worker_env``), the model built in
one call and the update run in later ones. Each side also reports what could differ: the calling thread, the
OpenMP / torch thread counts, the CPU affinity, the environment variables that steer OpenMP / MKL / oneDNN /
malloc, and the OpenMP / malloc libraries loaded; per update, the process's CPU seconds, minor page faults, context
switches and its busiest threads. ``--vllm`` then builds a vLLM CPU engine on both sides (one generate call, as a
rank holds it) and times the update again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "ONEDNN_", "DNNL_", "LRU_", "MALLOC_", "LD_PRELOAD", "RAY_OMP")


class Probe:
    """The timed work; the same object runs in the driver and, wrapped by ``ray.remote``, in a Ray actor."""

    def __init__(self, threads: int, micro: int = 8, per_prompt: bool = False) -> None:
        self.threads, self.micro, self.per_prompt = threads, micro, per_prompt
        self.model: Any = None

    def setup(self) -> dict[str, Any]:
        import torch

        from workers.fsdp.precision import flush_denormals

        flush_denormals(torch.device("cpu"))  # as the worker's init_model does
        torch.set_num_threads(self.threads)
        return self.diagnostics()

    def diagnostics(self) -> dict[str, Any]:
        import torch

        maps = Path("/proc/self/maps").read_text()
        libs = sorted({line.rsplit("/", 1)[-1] for line in maps.splitlines() if "omp" in line or "malloc" in line})
        return {
            "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "is_main_thread": threading.current_thread() is threading.main_thread(),
            "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "nice": os.nice(0),
            "grad_enabled": torch.is_grad_enabled(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
            "omp_malloc_libs": libs,
        }

    def micro_ops(self, reps: int = 5) -> dict[str, float]:
        """Median milliseconds of three ops the worker's profile showed slower than outside it."""
        import torch

        torch.manual_seed(0)
        x, g = torch.randn(160, 576), torch.randn(160, 49152)
        logits = torch.log_softmax(torch.randn(165, 49152) * 30, dim=-1).clamp(min=-87.0)
        tiny = torch.full((165, 49152), 1e-39)
        ops = {
            "head_wgrad_gemm_ms": lambda: g.t() @ x,
            "exp_chunk_ms": lambda: torch.exp(logits),
            "denormal_mul_ms": lambda: tiny * 0.5,
        }
        out = {}
        for name, op in ops.items():
            op()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                op()
                times.append((time.perf_counter() - start) * 1e3)
            out[name] = statistics.median(times)
        return out

    def build(self) -> None:
        import torch
        import torch.distributed as dist
        from transformers import AutoTokenizer

        from bench.update_breakdown import _batch
        from rlhf_ops.config.precision import resolve_precision
        from rlhf_ops.config.schema import FSDPConfig, OptimConfig
        from rlhf_ops.models.resolve import resolve_model_path
        from workers.fsdp import build_device_mesh, build_fsdp_model, build_optimizer
        from workers.fsdp.precision import cpu_has_native_bf16

        model_dir = resolve_model_path("builtin:smollm2-135m-instruct")
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(29_500 + os.getpid() % 2000)
            dist.init_process_group("gloo", rank=0, world_size=1)
        self.batch = _batch(AutoTokenizer.from_pretrained(model_dir), prompts=8, n=4, max_new=32, seed=0)
        fsdp = FSDPConfig(single_rank_plain=True)
        self.dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
        self.model = build_fsdp_model(
            model_dir,
            kind="causal_lm",
            mesh=build_device_mesh(1),
            cfg=fsdp,
            device="cpu",
            precision=resolve_precision(self.dtype, fsdp, trained=True, device="cpu"),
        )
        if self.per_prompt:  # actor.share_prompt_attention=per_prompt
            from workers.utils.prompt_group_attention import enable_per_prompt_attention

            enable_per_prompt_attention(self.model)
        self.optimizer = build_optimizer(self.model, OptimConfig(lr=1e-7))
        torch.manual_seed(0)

    def build_engine(self) -> dict[str, Any]:
        """A vLLM CPU engine in this process, as the rollout builds it, and one generate call (the worker's state)."""
        from vllm import LLM, SamplingParams

        from rlhf_ops.models.resolve import resolve_model_path

        self.engine = LLM(
            resolve_model_path("builtin:smollm2-135m-instruct"),
            dtype="float32",
            enforce_eager=True,
            seed=0,
            kv_cache_memory_bytes=256 << 20,
            skip_tokenizer_init=True,
            disable_log_stats=True,
            max_model_len=96,
            enable_chunked_prefill=False,
            generation_config="vllm",
        )
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(range(100, 145))) for _ in range(8)]
        self.engine.generate(prompts, SamplingParams(n=4, max_tokens=32, temperature=1.0), use_tqdm=False)
        return self.diagnostics()

    def update(self, reps: int) -> list[dict[str, float]]:
        from bench.update_breakdown import _update_once

        keep = self.dtype == "bfloat16"
        out = []
        for _ in range(reps):
            before, threads0 = _usage(), _thread_cpu()
            times = _update_once(self.model, self.optimizer, self.batch, micro=self.micro, keep=keep)
            after, threads1 = _usage(), _thread_cpu()
            times |= {k: after[k] - before[k] for k in after}
            busy = sorted(
                ((threads1[t][1] - threads0.get(t, (0, 0.0))[1], threads1[t][0]) for t in threads1), reverse=True
            )
            times["busiest_threads"] = [(name, round(sec, 2)) for sec, name in busy[:6]]  # type: ignore[assignment]
            times["n_threads"] = len(threads1)
            out.append(times)
        return out


def _usage() -> dict[str, float]:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "utime": r.ru_utime,
        "stime": r.ru_stime,
        "minflt": r.ru_minflt,
        "nvcsw": r.ru_nvcsw,
        "nivcsw": r.ru_nivcsw,
    }


def _thread_cpu() -> dict[str, tuple[str, float]]:
    """CPU seconds per thread of this process (utime + stime from /proc), with the thread's name."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="timed mini-batches per side per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (actor, driver, actor, ...)")
    parser.add_argument("--vllm", action="store_true", help="then build a vLLM engine on both sides and time again")
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the 32-row mini-batch")
    parser.add_argument(
        "--per-prompt", action="store_true", help="attention per prompt group (actor.share_prompt_attention)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"})
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    for key in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(key, "64")

    import ray

    ray.init(
        address="local",  # a cluster of its own, never another job's
        include_dashboard=False,
        num_cpus=args.threads,
        runtime_env={
            "env_vars": {
                "OMP_NUM_THREADS": str(args.threads),
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
                "LRU_CACHE_CAPACITY": "64",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            }
        },
    )
    remote = ray.remote(Probe).options(num_cpus=args.threads, max_restarts=0)
    actor = remote.remote(args.threads, args.micro, args.per_prompt)
    local = Probe(args.threads, args.micro, args.per_prompt)
    result: dict[str, Any] = {"threads": args.threads, "micro": args.micro, "per_prompt": args.per_prompt}
    result["diag"] = {"actor": ray.get(actor.setup.remote()), "driver": local.setup()}
    ray.get(actor.build.remote())
    local.build()
    # after the build, from the calling thread the update will use
    result["diag_after_build"] = {"actor": ray.get(actor.diagnostics.remote()), "driver": local.diagnostics()}
    ray.get(actor.update.remote(1))  # warm-up: oneDNN primitives, first-touch pages
    local.update(1)
    runs: dict[str, list[dict[str, float]]] = {"actor": [], "driver": []}
    micro: dict[str, list[dict[str, float]]] = {"actor": [], "driver": []}
    for _ in range(args.rounds):
        micro["actor"].append(ray.get(actor.micro_ops.remote()))
        runs["actor"] += ray.get(actor.update.remote(args.reps))
        micro["driver"].append(local.micro_ops())
        runs["driver"] += local.update(args.reps)
    if args.vllm:
        result["diag_vllm"] = {"actor": ray.get(actor.build_engine.remote()), "driver": local.build_engine()}
        for side in ("actor", "driver"):
            runs[side + "+vllm"], micro[side + "+vllm"] = [], []
        ray.get(actor.update.remote(1))
        local.update(1)
        for _ in range(args.rounds):
            micro["actor+vllm"].append(ray.get(actor.micro_ops.remote()))
            runs["actor+vllm"] += ray.get(actor.update.remote(args.reps))
            micro["driver+vllm"].append(local.micro_ops())
            runs["driver+vllm"] += local.update(args.reps)
    summary = {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
        | {"dtype": local.dtype}
        for side, rs in runs.items()
    }
    micro_summary = {side: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for side, ms in micro.items()}
    result |= {"runs": runs, "summary": summary, "micro": micro_summary}
    for side in ("actor", "driver"):
        d = result["diag_after_build"][side]
        print(
            f"{side}: thread {d['thread']} (main: {d['is_main_thread']}), torch threads {d['torch_threads']}, "
            f"interop {d['interop_threads']}, affinity {d['affinity']}, env {d['env']}, libs {d['omp_malloc_libs']}"
        )
    print(
        f"\n| side ({local.dtype}) | forward (s) | backward (s) | step (s) | update (s) | head wgrad GEMM (ms) | "
        "exp chunk (ms) | denormal mul (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for side in runs:
        s, m = summary[side], micro_summary[side]
        print(
            f"| {side} | {s['forward']:.2f} | {s['backward']:.2f} | {s['step']:.3f} | {s['total']:.2f} | "
            f"{m['head_wgrad_gemm_ms']:.1f} | {m['exp_chunk_ms']:.1f} | {m['denormal_mul_ms']:.1f} |"
        )
    for side in runs:
        s = summary[side]
        print(
            f"{side}: utime {s['utime']:.2f} stime {s['stime']:.2f} minflt {s['minflt']:.0f} nvcsw {s['nvcsw']:.0f} "
            f"nivcsw {s['nivcsw']:.0f}; threads {runs[side][-1]['n_threads']}, "
            f"busiest {runs[side][-1]['busiest_threads']}"
        )
    for suffix in ("", "+vllm"):
        if "actor" + suffix in summary:
            ratio = summary["actor" + suffix]["total"] / summary["driver" + suffix]["total"]
            result["actor_over_driver" + suffix] = ratio
            print(f"update in the actor / in the driver{suffix}: {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
