"""How cost grows with work: s/step, stage times and peak RSS over prompts x samples x new tokens, with the cost model.

    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/scaling.py --shapes 8x4x32,8x8x128 --out scale-a.json
    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/scaling.py --shapes 16x8x256 --steps 2 --out scale-b.json
    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/scaling.py --shapes 8x4x32 --trl --skip-platform --out t.json
    .venv/bin/python bench/scaling.py --report scale-a.json scale-b.json t.json    # the merged tables

The workload is ``bench_vs_trl.py``'s (SmolLM2-135M-Instruct, GRPO + k3 KL loss, the addition prompts and reward)
at other sizes: ``PxNxT`` is P prompts per step, N samples each, up to T new tokens. Each shape runs the platform's
best 2-core setting (``--variant``, default ``1x2-bf16-plain`` where the CPU has native bf16, else ``1x2-plain``):
one optimizer step per step (mini-batch = P), update and log-prob micro-batches of 8 rows (two prompt groups at
N=4, one at N=8), a vLLM KV cache sized to hold every sequence of the step (at least 256 MiB). ``--trl`` runs TRL's
``GRPOTrainer`` on the same shape in its own venv (``bench_vs_trl.py``'s).

Per shape, in the same run: the matmul peaks at the start (``bench_vs_trl.matmul_peak``), the platform's steps
(s/step and stages: the median after the first step, which pays oneDNN's primitive creation; every step kept in
the JSON), the worker's peak RSS, the load average before and after; then the update's GEMM floor at that run's
shapes (``update_breakdown.gemm_floor``: every linear's forward, input- and weight-gradient GEMM of each
micro-batch, in the variant's dtype, at the run's mean prompt and response lengths; attention's N x N products over
the packed micro-batch are not in it, their FLOPs are printed beside) and the cost model's prediction
(``rlhf_ops.cost_check.predict`` with the run's peaks and mean lengths) with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench_vs_trl import (  # noqa: E402
    RANK_VARIANTS,
    ensure_trl_venv,
    matmul_peak,
    platform_env,
    platform_overrides,
    run_platform,
)
from trl_workload import make_rows, write_jsonl  # noqa: E402

MIN_KV = 256 << 20
MICRO_ROWS = 8


def parse_shape(text: str) -> tuple[int, int, int]:
    """``PxNxT`` -> (prompts, samples, new tokens)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        sys.exit(f"--shapes: {text!r} is not PxNxT (prompts x samples x new tokens), e.g. 8x4x32")
    p, n, t = (int(x) for x in parts)
    return p, n, t


def kv_cache_bytes(model_dir: str, prompts: int, n: int, new: int, prompt_max: int = 64) -> int:
    """vLLM KV cache (fp32) that holds every sequence of a step at its longest, at least 256 MiB."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    need = per_token * prompts * n * (prompt_max + new)
    return max(MIN_KV, -(-int(need * 1.1) // (64 << 20)) * (64 << 20))


def shape_overrides(model_dir: str, data: Path, work: Path, run: str, shape: tuple[int, int, int], steps: int):
    p, n, t = shape
    ns = argparse.Namespace(steps=steps, platform_override=[])
    base = platform_overrides(model_dir, data, ns, work, run)
    return [
        *base,
        f"data.train_batch_size={p}",
        f"actor.ppo_mini_batch_size={p}",
        f"rollout.n={n}",
        f"rollout.max_new_tokens={t}",
        f"actor.ppo_micro_batch_size_per_gpu={MICRO_ROWS}",
        f"actor.log_prob_micro_batch_size_per_gpu={MICRO_ROWS}",
        f"ref.log_prob_micro_batch_size_per_gpu={MICRO_ROWS}",
        f"rollout.kv_cache_memory_bytes={kv_cache_bytes(model_dir, p, n, t)}",
    ]


def _after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize(steps: list[dict[str, Any]], seqs: int) -> dict[str, Any]:
    stages = sorted({k for s in steps for k in s if k.startswith("timing_s/") and "/worker/" not in k})
    return {
        "s_per_step": _after_first([s["perf/time_per_step"] for s in steps]),
        "step_s_all": [round(s["perf/time_per_step"], 2) for s in steps],
        "s_min_after_first": min(s["perf/time_per_step"] for s in (steps[1:] or steps)),
        "tokens_per_step": _after_first([s["perf/total_num_tokens"] for s in steps]),
        "prompt_len": _after_first([s["prompt_length/mean"] for s in steps]),
        "response_len": _after_first([s["response_length/mean"] for s in steps]),
        "peak_rss_gb": max(s.get("perf/cpu_peak_rss_gb", 0.0) for s in steps),
        "stages": {k.removeprefix("timing_s/"): _after_first([s.get(k, 0.0) for s in steps]) for k in stages},
        "reward": [s.get("critic/score/mean", float("nan")) for s in steps],
        "sequences": seqs,
    }


def prediction(model_dir: str, overrides: list[str], peak: dict[str, float], measured: dict[str, Any]):
    """The cost model's s/step, stages and peak RSS for this run (its peaks, its mean lengths)."""
    from rlhf_ops.config import load_config
    from rlhf_ops.cost_check import model_shapes, predict
    from rlhf_ops.cost_model import Peaks
    from rlhf_ops.host_peaks import host_peaks

    config = load_config("tiny-cpu", overrides)
    shapes = model_shapes(model_dir)
    cached = host_peaks(config.resources.threads_per_worker)
    assert shapes is not None and cached is not None
    bf16 = str(config.actor.fsdp.mixed_precision.param_dtype) == "bfloat16"
    peaks = Peaks(
        name="bench run",
        flops=peak["bfloat16" if bf16 else "float32"] * 1e9,
        rollout_flops=peak["float32"] * 1e9,
        fp32_flops=peak["float32"] * 1e9,
        bandwidth=cached["bandwidth"],
        memory_bytes=cached["memory_bytes"],
        measured=True,
    )
    p = predict(
        config, peaks=peaks, shapes=shapes, prompt_len=measured["prompt_len"], response_len=measured["response_len"]
    )
    return {"s_per_step": p.step_seconds, "stages": p.seconds, "peak_rss_gb": p.memory_bytes / 2**30}


def update_floor(
    model_dir: str, shape: tuple[int, int, int], measured: dict[str, Any], *, dtype: str = "bfloat16"
) -> dict[str, float]:
    """The update's GEMM floor in ``dtype`` at the run's micro-batches (mean lengths), and attention's FLOPs."""
    from update_breakdown import gemm_floor, gemm_shapes

    p, n, _ = shape
    shapes = gemm_shapes(model_dir)
    rows = min(MICRO_ROWS, p * n)
    groups = max(rows / n, 1.0)
    fwd = round(groups * measured["prompt_len"] + rows * measured["response_len"])
    kept = round(rows * measured["response_len"])
    micros = [(fwd, kept)] * max(1, (p * n) // rows)
    floor = gemm_floor(shapes, micros, dtype=dtype)
    # Dense attention over the packed micro-batch: QK^T and AV, 2 N^2 h FLOPs each per block, x3 for the update.
    attention = 3 * 4 * fwd**2 * shapes["hidden"] * shapes["layers"] * len(micros)
    return {
        "gemm_floor_s": floor,
        "micro_tokens": fwd,
        "micro_batches": len(micros),
        "attention_gflop": attention / 1e9,
    }


def run_trl_shape(model_dir: str, data: Path, work: Path, shape: tuple[int, int, int], steps: int) -> dict[str, Any]:
    import subprocess

    p, n, t = shape
    out = work / f"trl-{p}x{n}x{t}.json"
    cmd = [str(ensure_trl_venv()), str(REPO / "bench" / "trl_side.py"), "--model", model_dir, "--data", str(data)]
    cmd += ["--steps", str(steps), "--threads", "2", "--prompts", str(p), "--n", str(n)]
    cmd += ["--max-new-tokens", str(t), "--out", str(out)]
    env = {k: v for k, v in platform_env(2).items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"TRL side failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    raw = json.loads(out.read_text())
    secs = [s["seconds"] for s in raw["steps"]]
    return {
        "s_per_step": _after_first(secs),
        "step_s_all": [round(s, 2) for s in secs],
        "tokens_per_step": _after_first([s.get("tokens", 0.0) for s in raw["steps"]]),
        "peak_rss_gb": raw["peak_rss_gb"],
    }


def predict_only(args: argparse.Namespace) -> None:
    """``--predict``: each shape's predicted s/step, stages and peak RSS at the cached peaks (nothing runs)."""
    from rlhf_ops.host_peaks import host_peaks
    from rlhf_ops.models.resolve import resolve_model_path
    from workers.fsdp.precision import cpu_has_native_bf16

    variant = args.variant or ("1x2-bf16-plain" if cpu_has_native_bf16() else "1x2-plain")
    model_dir = resolve_model_path(args.model)
    cached = host_peaks(2)
    assert cached is not None
    peak = {"float32": cached["float32"] / 1e9, "bfloat16": cached["bfloat16"] / 1e9}
    for text in args.shapes.split(","):
        shape = parse_shape(text)
        overrides = shape_overrides(model_dir, Path("rows.jsonl"), Path("work"), "predict", shape, args.steps)
        response = min(args.response_len, shape[2]) if args.response_len else float(shape[2])
        lengths = {"prompt_len": args.prompt_len, "response_len": response}
        p = prediction(model_dir, overrides + RANK_VARIANTS[variant], peak, lengths)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in p["stages"].items())
        print(
            f"{text} ({variant}, prompt {lengths['prompt_len']:.0f}, response {lengths['response_len']:.0f}): "
            f"{p['s_per_step']:.1f} s/step ({stages}), {args.steps} steps {p['s_per_step'] * args.steps / 60:.1f} "
            f"min, peak RSS {p['peak_rss_gb']:.2f} GiB"
        )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from rlhf_ops.host_peaks import host_peaks
    from rlhf_ops.models.resolve import resolve_model_path
    from workers.fsdp.precision import cpu_has_native_bf16

    variant = args.variant or ("1x2-bf16-plain" if cpu_has_native_bf16() else "1x2-plain")
    model_dir = resolve_model_path(args.model)
    host_peaks(2)  # cached after the first call (the bandwidth the model reads)
    work = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    results: dict[str, Any] = {"variant": variant, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for text in args.shapes.split(","):
        shape = parse_shape(text)
        p, n, t = shape
        steps = args.steps
        data = write_jsonl(work / f"rows-{text}.jsonl", make_rows(p * max(steps, args.trl_steps), seed=0))
        row: dict[str, Any] = {"shape": text, "load_before": os.getloadavg()}
        row["peak"] = matmul_peak(2)
        print(f"{text}: load {row['load_before']}, matmul peak {row['peak']}", flush=True)
        if not args.skip_platform:
            run = f"scale-{text}"
            overrides = shape_overrides(model_dir, data, work, run, shape, steps) + RANK_VARIANTS[variant]
            start = time.perf_counter()
            raw = run_platform("tiny-cpu", overrides, work, run, threads=2)
            row["wall_s"] = time.perf_counter() - start
            row["platform"] = summarize(raw["steps"], p * n)
            row["predicted"] = prediction(model_dir, overrides, row["peak"], row["platform"])
            bf16 = "bf16" in variant  # the variant's compute dtype: its GEMMs are the floor's
            row["update_floor"] = update_floor(
                model_dir, shape, row["platform"], dtype="bfloat16" if bf16 else "float32"
            )
            print(f"{text} platform: {json.dumps(row['platform'])}", flush=True)
            print(f"{text} predicted: {json.dumps(row['predicted'])}", flush=True)
            print(f"{text} update floor: {json.dumps(row['update_floor'])}", flush=True)
        if args.trl:
            start = time.perf_counter()
            row["trl"] = run_trl_shape(model_dir, data, work, shape, args.trl_steps)
            row["trl"]["wall_s"] = time.perf_counter() - start
            print(f"{text} TRL: {json.dumps(row['trl'])}", flush=True)
        row["load_after"] = os.getloadavg()
        results.setdefault("rows", []).append(row)
        if args.out:  # after every shape: a run cut short keeps what it measured
            args.out.write_text(json.dumps(results, indent=1))
    return results


def report(files: list[Path]) -> None:
    """The tables of one or more ``--out`` files, one row per shape and file (the file's stem names the run)."""
    rows: dict[str, dict[str, Any]] = {}
    for f in files:
        for row in json.loads(f.read_text())["rows"]:
            row["loads"] = [(row["load_before"][0], row["load_after"][0])]
            rows[f"{row['shape']} ({f.stem})"] = row
    print(
        "| shape | tokens/step | s/step (stages) | every step (s) | peak RSS GiB | predicted s/step (ratio) "
        "| pred RSS (ratio) | TRL s/step, RSS (every step) | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, r in rows.items():
        pl, pr, trl = r.get("platform"), r.get("predicted"), r.get("trl")
        load = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in r["loads"])
        trl_cell = f"{trl['s_per_step']:.1f}, {trl['peak_rss_gb']:.2f} ({trl['step_s_all']})" if trl else "-"
        if pl is None:
            print(f"| {shape} | - | - | - | - | - | - | {trl_cell} | {load} |")
            continue
        stages = ", ".join(f"{k} {v:.1f}" for k, v in pl["stages"].items() if k in ("gen", "ref", "update_actor"))
        print(
            f"| {shape} | {pl['tokens_per_step']:.0f} | {pl['s_per_step']:.1f} ({stages}) | {pl['step_s_all']} | "
            f"{pl['peak_rss_gb']:.2f} | "
            f"{pr['s_per_step']:.1f} ({pr['s_per_step'] / pl['s_per_step']:.2f}) | "
            f"{pr['peak_rss_gb']:.2f} ({pr['peak_rss_gb'] / pl['peak_rss_gb']:.2f}) | {trl_cell} | {load} |"
        )
    print("\n| shape | stage | predicted s | measured s | ratio |")
    print("|---|---|---|---|---|")
    for shape, r in rows.items():
        if "platform" not in r:
            continue
        for stage in ("gen", "ref", "update_actor"):
            pred, meas = r["predicted"]["stages"].get(stage, 0.0), r["platform"]["stages"].get(stage, 0.0)
            print(f"| {shape} | {stage} | {pred:.2f} | {meas:.2f} | {pred / meas if meas else float('nan'):.2f} |")
    print("\n| shape | update (s) | GEMM floor (s) | x floor | micro-batch tokens x count | attention GFLOP |")
    print("|---|---|---|---|---|---|")
    for shape, r in rows.items():
        if "update_floor" not in r:
            continue
        u, fl = r["platform"]["stages"].get("update_actor", 0.0), r["update_floor"]
        print(
            f"| {shape} | {u:.2f} | {fl['gemm_floor_s']:.2f} | {u / fl['gemm_floor_s']:.1f}x | "
            f"{fl['micro_tokens']} x {fl['micro_batches']} | {fl['attention_gflop']:.0f} |"
        )
    measured = [(name, r["platform"]) for name, r in rows.items() if "platform" in r]
    if len(measured) >= 2:
        base = measured[0][1]
        print(f"\ntokens-linearity against {measured[0][0]}: s/step ratio / tokens/step ratio (1.00: linear)")
        for name, pl in measured[1:]:
            tok = pl["tokens_per_step"] / base["tokens_per_step"]
            med = pl["s_per_step"] / base["s_per_step"]
            best = min(pl["step_s_all"][1:] or pl["step_s_all"]) / min(base["step_s_all"][1:] or base["step_s_all"])
            print(
                f"  {name}: tokens x{tok:.2f}; median s/step x{med:.2f} ({med / tok:.2f} of linear), "
                f"quietest step after the first x{best:.2f} ({best / tok:.2f})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x4x32,8x8x128,16x8x256", help="comma-separated PxNxT")
    parser.add_argument("--steps", type=int, default=3, help="platform steps per shape (the median skips the first)")
    parser.add_argument("--variant", default=None, help="a bench_vs_trl.py variant (default: the best on 2 cores)")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--trl", action="store_true", help="also run TRL on each shape")
    parser.add_argument("--trl-steps", type=int, default=2)
    parser.add_argument("--skip-platform", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--predict",
        action="store_true",
        help="run nothing: the cost model's prediction of each shape at this host's cached peaks (as `rlhf cost`)",
    )
    parser.add_argument("--prompt-len", type=float, default=45.0, help="--predict: mean prompt tokens")
    parser.add_argument("--response-len", type=float, default=None, help="--predict: mean response (<= T)")
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="print the tables of these --out files")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    if args.variant and args.variant not in RANK_VARIANTS:
        sys.exit(f"--variant: unknown {args.variant}; choose from {', '.join(RANK_VARIANTS)}")
    if args.predict:
        predict_only(args)
        return
    measure(args)
    if args.out:
        report([args.out])


if __name__ == "__main__":
    main()
