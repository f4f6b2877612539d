"""``rlhf train`` vs TRL ``GRPOTrainer`` on the same real model and workload, one after the other.

    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/bench_vs_trl.py            # ~12-16 min on 2 cores
    .venv/bin/python bench/bench_vs_trl.py --steps 3 --skip-tiny                   # a quick look

Workload (both sides): SmolLM2-135M-Instruct (``builtin:smollm2-135m-instruct``, one model directory), GRPO
with a k3 KL loss of 0.04 to the reference, 8 prompts x 4 samples per step, up to 32 new tokens at
temperature 1, lr 1e-6 constant, grad clip 1, token-mean loss, the chat prompts and reward of
``bench/trl_workload.py``. TRL runs in its own venv (``.bench/trl-venv``, created here: torch 2.13.0 from the
machine's wheel folder, ``trl``, the platform's transformers; never ``--system-site-packages``), so TRL never
enters the platform's environment.

Settings (each side's best on 2 cores): TRL: one process, 2 torch threads, HF ``generate``, fp32 (``--trl-bf16``
tries bf16 autocast). Platform: vLLM rollout, each prompt forwarded once for its 4 samples
(``actor.share_prompt_prefix``) on packed rows, the fused log-prob/entropy, the old-log-prob pass skipped
(on-policy), fp32; run as 1 rank x 2 threads (``resources.num_cpus_per_worker=2``) and as 2 ranks x 1 thread
(``--variants``; ``1x2-unshared`` is 1x2 without shared prompts, ``1x2-bf16`` is 1x2 with bf16 autocast,
``1x2-bf16-gs1`` adds one gradient reduce-scatter per mini-batch, ``1x2-bf16-plain`` runs the one-rank actor and
reference without FSDP2: ``fsdp.single_rank_plain``), the fastest one reported, every variant's per-step reward
printed. ``--platform-override key=value`` adds overrides.

Prints s/step (median after the first step), tokens/s (prompt + response, valid), peak RSS per process, the
ratio; a per-stage table (FLOPs from the model's shapes, time, fraction of the matmul peak measured here in
fp32 and bf16); each variant's peak RSS per stage (``memory/actor/<stage>/peak_rss_gb``); and the tiny-model run's
per-step overhead beyond the workers' compute. ``--out`` gets JSON.

``--skip-trl`` without ``--trl-result`` runs the platform variants only (no TRL column, no ratio). With two or more
variants the report adds a per-step reward table (mean score over the 32 samples of each step, side by side) and a
noise statement: the mean absolute per-step difference of each variant to the first one against the per-step
standard error of that difference (binary rewards: ``sqrt(p1 (1 - p1) / 32 + p2 (1 - p2) / 32)``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRL_VENV = REPO / ".bench" / "trl-venv"
TRL_REQS = ["trl==1.16.0", "transformers==5.19.0", "psutil"]
sys.path.insert(0, str(REPO / "bench"))
from trl_workload import make_rows, write_jsonl  # noqa: E402
from vs_trl_report import print_report, print_reward_curves, print_stage_rss  # noqa: E402
from vs_trl_variants import AUTO_VARIANTS, RANK_VARIANTS, host_kind, variant_names  # noqa: E402, F401 (re-exported)


# ---------------------------------------------------------------------------------------------- setup
def ensure_trl_venv() -> Path:
    """The bench-only venv with TRL (idempotent: a stamp of the requirements)."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".bench-stamp"
    want = " ".join(["torch==2.13.0", *TRL_REQS])
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return python
    if python.exists():  # built by hand or by an older bench: keep it when the versions match
        check = "import trl, torch, transformers; print(trl.__version__, torch.__version__, transformers.__version__)"
        found = subprocess.run([str(python), "-c", check], capture_output=True, text=True).stdout.split()
        if found[:1] == ["1.16.0"] and found[1:2] == ["2.13.0+cpu"] and found[2:3] == ["5.19.0"]:
            stamp.write_text(want)
            return python
    subprocess.run(["python3.11", "-m", "venv", str(TRL_VENV)], check=True)  # no --system-site-packages
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip>=25", "wheel"], check=True)
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # alone first: the CPU wheel from the local folder
    subprocess.run([*pip, *TRL_REQS], check=True)
    stamp.write_text(want)
    return python


def platform_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # the workload's reward function lives in bench/ (the platform loads rewards from an allow-list)
            "RLHF_ALLOWED_CODE_MODULES": "bench",
        }
    )
    return env


# ---------------------------------------------------------------------------------------------- peak
def matmul_peak(threads: int, *, seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s of the model's matmul shapes (tokens x 576 x 1536, 1536 x 576, an LM-head slice), fp32 and bf16.

    Each shape repeats for about ``seconds`` (at least once): a CPU without bf16 instructions runs bf16 GEMMs
    50x slower than fp32, and a fixed repeat count would then take minutes.
    """
    import torch

    torch.set_num_threads(threads)
    out: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        best = 0.0
        for m, k, n in ((1024, 576, 1536), (1024, 1536, 576), (1024, 576, 49152 // 8)):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            a @ b  # warm-up (oneDNN / packing)
            reps, start = 0, time.perf_counter()
            while reps == 0 or time.perf_counter() - start < seconds / 3:
                a @ b
                reps += 1
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
        out[str(dtype).removeprefix("torch.")] = best
    return out


# ---------------------------------------------------------------------------------------------- flops
def model_shapes(model_dir: str) -> dict[str, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", h // heads)
    per_layer = h * heads * head_dim * 2 + 2 * h * kv * head_dim + 3 * h * inter  # q, o, k, v, mlp
    return {"body": layers * per_layer, "head": h * cfg["vocab_size"], "layers": layers, "hidden": h}


def stage_flops(
    shapes: dict[str, int], *, tokens: float, forward_tokens: float, response_tokens: float, seqs: int
) -> dict[str, float]:
    """Matmul FLOPs of one step's stages (2 per multiply-add; attention scores are <1% at these lengths).

    Forward over the tokens the forwards run on (``forward_tokens``: each shared prompt once) through the body; the
    LM head only at the positions that predict response tokens (``logits_to_keep``), one per response token.
    Generation: prefill + one decode step per response token over all ``tokens`` (vLLM's prefix cache aside), the
    head once per generated token. The update: forward + backward (2x) = 3x a forward.
    """
    body, head = shapes["body"], shapes["head"]
    forward = 2 * body * forward_tokens + 2 * head * response_tokens
    return {
        "gen": 2 * body * tokens + 2 * head * (response_tokens + seqs),
        "old_log_prob": forward,
        "ref": forward,
        "update_actor": 3 * forward,
    }


# ---------------------------------------------------------------------------------------------- runs
def run_trl(python: Path, model_dir: str, data: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "trl.json"
    cmd = [
        str(python),
        str(REPO / "bench" / "trl_side.py"),
        "--model",
        model_dir,
        "--data",
        str(data),
        "--steps",
        str(args.steps),
        "--threads",
        "2",
        "--out",
        str(out),
    ]
    if args.trl_bf16:
        cmd.append("--bf16")
    env = {k: v for k, v in platform_env(2).items() if k != "PYTHONPATH"}  # TRL never sees the platform
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"TRL side failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def platform_overrides(model_dir: str, data: Path, args: argparse.Namespace, work: Path, run: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "model.attn_implementation=sdpa",
        f"data.train_files=[{data}]",
        "data.val_files=[]",
        "data.max_prompt_length=64",
        "data.apply_chat_template=true",
        "data.train_batch_size=8",
        "data.shuffle=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.04",
        "algorithm.kl_loss_type=low_var_kl",
        "algorithm.entropy_coeff=0.0",
        "actor.optim.lr=1e-6",
        "actor.ppo_mini_batch_size=8",
        # Two whole groups of 4 per micro-batch, each prompt forwarded once (actor.share_prompt_prefix): a packed
        # row of all 32 sequences would pay sdpa's dense mask over ~2,600 tokens (more attention than matmuls).
        "actor.ppo_micro_batch_size_per_gpu=8",
        "actor.log_prob_micro_batch_size_per_gpu=8",
        "ref.log_prob_micro_batch_size_per_gpu=8",
        "actor.use_remove_padding=true",
        "actor.share_prompt_prefix=true",
        "rollout.engine=vllm",
        "rollout.n=4",
        "rollout.max_new_tokens=32",
        "rollout.temperature=1.0",
        f"rollout.kv_cache_memory_bytes={256 << 20}",
        "reward.reward_fn=bench.trl_workload:compute_score",
        "resources.nproc_per_node=1",  # the 2-rank variant overrides these (see RANK_VARIANTS)
        "resources.num_cpus_per_worker=2",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=1000",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        f"trainer.checkpoint_root={work / 'ckpt'}",
        f"trainer.run_name={run}",
        "trainer.logger=[jsonl]",
        *args.platform_override,
    ]


def run_platform(preset: str, overrides: list[str], work: Path, run: str, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=platform_env(threads), cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"platform run {run} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    metrics_files = list((work / "ckpt").glob(f"*/{run}/metrics.jsonl"))
    if not metrics_files:
        sys.exit(f"platform run {run}: no metrics.jsonl under {work / 'ckpt'}")
    steps = [json.loads(line) for line in metrics_files[0].read_text().splitlines() if line.strip()]
    steps = [s.get("metrics", s) for s in steps]
    return {"steps": steps, "wall_s": time.perf_counter() - start}


def _median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize_trl(result: dict[str, Any]) -> dict[str, float]:
    steps = result["steps"]
    sec = _median_after_first([s["seconds"] for s in steps])
    tokens = _median_after_first([s["tokens"] for s in steps])
    return {
        "s_per_step": sec,
        "tokens_per_s": tokens / sec,
        "peak_rss_gb": result["peak_rss_gb"],
        "tokens_per_step": tokens,
        "reward": [s.get("reward", float("nan")) for s in steps],
    }


def summarize_platform(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    sec = _median_after_first([s["perf/time_per_step"] for s in steps])
    tokens = _median_after_first([s["perf/total_num_tokens"] for s in steps])
    stages = sorted({k for s in steps for k in s if k.startswith("timing_s/")})
    return {
        "s_per_step": sec,
        "tokens_per_s": tokens / sec,
        "tokens_per_step": tokens,
        "peak_rss_gb": max(s.get("perf/cpu_peak_rss_gb", 0.0) for s in steps),
        "response_tokens": _median_after_first(
            [s["response_length/mean"] * 32 for s in steps]  # 8 prompts x 4 samples
        ),
        "prompt_tokens": _median_after_first([s["prompt_length/mean"] * 32 for s in steps]),
        "stages": {k.removeprefix("timing_s/"): _median_after_first([s.get(k, 0.0) for s in steps]) for k in stages},
        "reward": [s.get("critic/score/mean", float("nan")) for s in steps],
        "rollout_probs_diff_max": [s.get("training/rollout_probs_diff_max", float("nan")) for s in steps],
        "torch_threads": steps[-1].get("perf/torch_threads", float("nan")),
        # memory/actor/<stage>/peak_rss_gb: the stage's sampled RSS peak, the largest over the steps
        "stage_peak_rss_gb": {
            "/".join(k.split("/")[1:3]): max(s.get(k, 0.0) for s in steps)
            for k in sorted({k for s in steps for k in s if k.startswith("memory/") and k.endswith("/peak_rss_gb")})
        },
    }


def tiny_overhead(work: Path, steps: int) -> dict[str, float]:
    """tiny-cpu (2 ranks, HF rollout): per-step time minus the workers' own compute seconds."""
    overrides = [
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.checkpoint_root={work / 'ckpt'}",
        "trainer.run_name=tiny",
        "trainer.logger=[jsonl]",
    ]
    result = run_platform("tiny-cpu", overrides, work, "tiny", threads=1)
    rows = result["steps"][1:] or result["steps"]
    overheads, step_s = [], []
    for s in rows:
        # Every second a worker spent computing (generate, weight sync, old log-prob, ref, update): the rest
        # of the step is the controller's overhead (Ray calls, (de)serialisation, dispatch, driver work).
        worker = sum(v for k, v in s.items() if k.startswith("timing_s/worker/"))
        overheads.append(s["perf/time_per_step"] - worker)
        step_s.append(s["perf/time_per_step"])
    return {"s_per_step": statistics.median(step_s), "overhead_s": statistics.median(overheads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per side (the median skips the first)")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--trl-bf16", action="store_true")
    parser.add_argument(
        "--skip-trl",
        action="store_true",
        help="reuse --trl-result instead of running TRL; without --trl-result, run the platform variants only",
    )
    parser.add_argument("--trl-result", type=Path, default=None)
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--tiny-steps", type=int, default=12)
    parser.add_argument(
        "--variants",
        default="auto",
        help="comma-separated, of " + ", ".join(RANK_VARIANTS) + " (ranks x threads; the fastest is reported); auto: "
        "per host kind (AMX: 1x2-plain, 1x2-bf16-plain, 1x2-bf16-full-mb16; AVX512-BF16: 1x2-plain, 1x2-bf16-plain, "
        "1x2-bf16-full; bf16 emulated: 1x2-plain, 1x2-plain-pp32)",
    )
    parser.add_argument("--platform-override", action="append", default=[], help="extra key=value (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write all results as JSON here")
    args = parser.parse_args()
    names = variant_names(args.variants)

    from rlhf_ops.models.resolve import resolve_model_path

    model_dir = resolve_model_path(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    print(f"work dir: {work} (TRL's result: trl.json, reusable with --skip-trl --trl-result)", flush=True)
    data = write_jsonl(work / "rows.jsonl", make_rows(8 * max(args.steps, 1), seed=0))
    started = time.perf_counter()
    peak = matmul_peak(2)
    print(f"matmul peak: {peak}", flush=True)
    trl_raw: dict[str, Any] | None = None
    if args.skip_trl and args.trl_result:
        trl_raw = json.loads(args.trl_result.read_text())
    elif not args.skip_trl:
        trl_raw = run_trl(ensure_trl_venv(), model_dir, data, args, work)
    trl = summarize_trl(trl_raw) if trl_raw is not None else None
    print(f"TRL: {trl if trl is not None else 'skipped (no --trl-result)'}", flush=True)
    variants: dict[str, dict[str, Any]] = {}
    for name in names:
        run = f"smollm2-{name}"
        overrides = platform_overrides(model_dir, data, args, work, run) + RANK_VARIANTS[name]
        raw = run_platform("tiny-cpu", overrides, work, run, threads=2)
        variants[name] = {"raw": raw, "summary": summarize_platform(raw)}
        print(f"platform {name}: {json.dumps(variants[name]['summary'])}", flush=True)
    best = min(variants, key=lambda n: variants[n]["summary"]["s_per_step"])
    plat = variants[best]["summary"]
    for name, v in variants.items():
        print(
            f"variant {name} (ranks x threads): {v['summary']['s_per_step']:.1f} s/step, "
            f"{v['summary']['tokens_per_s']:.0f} tokens/s, stages {v['summary']['stages']}, "
            f"reward per step {[round(r, 3) for r in v['summary']['reward']]}"
        )
    # Work actually done: with shared prompts each prompt is forwarded once for its 4 samples.
    shared = "actor.share_prompt_prefix=false" not in RANK_VARIANTS[best] + args.platform_override
    forwarded = plat["tokens_per_step"] - (plat["prompt_tokens"] * 3 / 4 if shared else 0.0)
    flops = stage_flops(
        model_shapes(model_dir),
        tokens=plat["tokens_per_step"],
        forward_tokens=forwarded,
        response_tokens=plat["response_tokens"],
        seqs=32,
    )
    flops = {k: v for k, v in flops.items() if k in plat["stages"]}
    tiny = None if args.skip_tiny else tiny_overhead(work, args.tiny_steps)
    labels = {
        "trl": f"1 process x 2 threads, HF generate, {'bf16 autocast' if args.trl_bf16 else 'fp32'}",
        "platform": f"{best[0]} rank(s) x {best[2]} thread(s), vLLM, shared prompts + remove padding, fused "
        "log-probs, on-policy (no old-log-prob pass)"
        + (", bf16 autocast (fp32 master)" if "-bf16" in best else ", fp32")
        + (", vLLM in bf16" if "rollout.dtype=bfloat16" in RANK_VARIANTS[best] else "")
        + f" [variant {best}, host {host_kind()}]"
        + (f", {' '.join(args.platform_override)}" if args.platform_override else ""),
    }
    print_report(trl, plat, peak, flops, tiny, labels)
    summaries = {n: v["summary"] for n, v in variants.items()}
    print_stage_rss(summaries, trl)
    noise = print_reward_curves(summaries, samples=32) if len(variants) > 1 else {}
    print(
        f"\nbench wall time: {time.perf_counter() - started:.0f} s (TRL {(trl_raw or {}).get('wall_s', 0):.0f} s, "
        f"platform {sum(v['raw']['wall_s'] for v in variants.values()):.0f} s)"
    )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "trl": trl,
                    "platform": plat,
                    "variants": summaries,
                    "reward_noise": noise,
                    "peak": peak,
                    "flops": flops,
                    "tiny": tiny,
                    "labels": labels,
                    "trl_raw": trl_raw,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
