"""The cost model's prediction for a ``bench_vs_trl.py`` run, beside what that run measured.

    .venv/bin/python bench/cost_vs_measured.py RESULT.json [--variant 1x2-bf16-plain] [--platform-override k=v ...]

RESULT.json is ``bench_vs_trl.py --out``'s file. The config is rebuilt from the same overrides (pass the same
``--platform-override`` values), the mean prompt and response lengths are the run's own, and the matmul peaks
are those the bench measured at the start of the same run (the host's load changes them); the bandwidth is this
host's cached one (``rlhf_ops.host_peaks``). Prints predicted vs measured seconds per stage, s/step and peak
RSS of the worker process, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_vs_trl import RANK_VARIANTS, platform_overrides  # noqa: E402

from rlhf_ops.config import load_config  # noqa: E402
from rlhf_ops.cost_check import model_shapes, predict  # noqa: E402
from rlhf_ops.cost_model import Peaks  # noqa: E402
from rlhf_ops.host_peaks import host_peaks  # noqa: E402

# Quiet runs of the same workload recorded in docs/benchmarks_vs_trl.md: host, variant, the bench's matmul peaks
# (GFLOP/s, fp32 / bf16), measured s/step, update, ref (s), peak RSS (GiB). The first two fitted the CPU constants.
DOC_ROWS = (
    ("AVX512-BF16 EPYC 12-04 (fit)", "1x2-bf16-plain", 191, 801, 8.9, 4.22, 1.06, 5.12),
    ("AVX512-BF16 EPYC 12-04 (fit)", "1x2-plain", 191, 801, 13.6, 8.39, 2.07, 4.60),
    ("AMX Xeon 12-05", "1x2-plain", 340, 2470, 13.2, 7.00, 1.70, 4.63),
    ("AMX Xeon 12-05", "1x2-bf16-plain", 340, 2470, 10.8, 4.41, 1.25, 4.99),
)


def doc_rows() -> None:
    """The model against the quiet rows above (mean prompt 45, response 20.6 tokens; bandwidth: this host's)."""
    cached = host_peaks(2)
    assert cached is not None
    model_dir = str(Path.home() / ".cache" / "rlhf_ops" / "smollm2-135m-instruct")
    shapes = model_shapes(model_dir)
    assert shapes is not None
    ns = argparse.Namespace(steps=3, platform_override=[])
    print("| host | variant | s/step pred / meas | update pred / meas | ref pred / meas | RSS pred / meas (GiB) |")
    print("|---|---|---|---|---|---|")
    for host, variant, fp32, bf16, step, update, ref, rss in DOC_ROWS:
        overrides = platform_overrides(model_dir, Path("/tmp/rows.jsonl"), ns, Path("/tmp/work"), "cost")
        config = load_config("tiny-cpu", overrides + RANK_VARIANTS[variant])
        peaks = Peaks(
            name=host,
            flops=(bf16 if "bf16" in variant else fp32) * 1e9,
            rollout_flops=fp32 * 1e9,
            fp32_flops=fp32 * 1e9,
            bandwidth=cached["bandwidth"],
            memory_bytes=cached["memory_bytes"],
            measured=True,
        )
        p = predict(config, peaks=peaks, shapes=shapes, prompt_len=45.0, response_len=20.6)
        cells = [
            (p.step_seconds, step),
            (p.seconds["update_actor"], update),
            (p.seconds["ref"], ref),
            (p.memory_bytes / 2**30, rss),
        ]
        print(f"| {host} | {variant} | " + " | ".join(f"{a:.2f} / {b:.2f} ({a / b:.2f})" for a, b in cells) + " |")


STAGES = {"gen": "gen", "ref": "ref", "old_log_prob": "old_log_prob", "update_actor": "update_actor"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, nargs="?", help="bench_vs_trl.py --out file; none: the documented rows")
    parser.add_argument("--variant", default="1x2-bf16-plain")
    parser.add_argument("--platform-override", action="append", default=[])
    args = parser.parse_args()
    if args.result is None:
        doc_rows()
        return
    result = json.loads(args.result.read_text())
    measured = result["variants"][args.variant]
    ns = argparse.Namespace(steps=3, platform_override=args.platform_override)
    model_dir = str(Path.home() / ".cache" / "rlhf_ops" / "smollm2-135m-instruct")
    overrides = platform_overrides(model_dir, Path("/tmp/rows.jsonl"), ns, Path("/tmp/work"), "cost")
    config = load_config("tiny-cpu", overrides + RANK_VARIANTS[args.variant])
    shapes = model_shapes(model_dir)
    if shapes is None:
        sys.exit(f"no config.json in {model_dir}: run `rlhf model resolve builtin:smollm2-135m-instruct` first")
    cached = host_peaks(config.resources.threads_per_worker)
    assert cached is not None
    bf16 = "bf16" in args.variant
    peak = result["peak"]  # GFLOP/s at the model's shapes, measured by the bench run itself
    peaks = Peaks(
        name="bench run",
        flops=peak["bfloat16" if bf16 else "float32"] * 1e9,
        rollout_flops=peak["float32"] * 1e9,  # the vLLM engine runs fp32 on CPU
        fp32_flops=peak["float32"] * 1e9,
        bandwidth=cached["bandwidth"],
        memory_bytes=cached["memory_bytes"],
        measured=True,
    )
    prompt_len = measured["prompt_tokens"] / 32  # the bench's summary multiplies per-sequence means by 32
    response_len = measured["response_tokens"] / 32
    prediction = predict(config, peaks=peaks, shapes=shapes, prompt_len=prompt_len, response_len=response_len)
    rows = []
    for stage, key in STAGES.items():
        if stage in prediction.seconds or key in measured["stages"]:
            rows.append((stage, prediction.seconds.get(stage, 0.0), measured["stages"].get(key, 0.0)))
    rows.append(("s/step", prediction.step_seconds, measured["s_per_step"]))
    rows.append(("peak RSS GiB", prediction.memory_bytes / 2**30, measured["peak_rss_gb"]))
    print(
        f"peaks: {peaks.flops / 1e9:.0f} GFLOP/s compute, {peaks.rollout_flops / 1e9:.0f} rollout, "
        f"{peaks.bandwidth / 1e9:.0f} GB/s; mean prompt {prompt_len:.1f}, response {response_len:.1f} tokens"
    )
    print(f"{'':<14}{'predicted':>10}{'measured':>10}{'ratio':>8}")
    for name, pred, meas in rows:
        ratio = pred / meas if meas else float("nan")
        print(f"{name:<14}{pred:>10.2f}{meas:>10.2f}{ratio:>8.2f}")
    print(json.dumps({"memory_gib": {k: round(v / 2**30, 3) for k, v in prediction.memory.items()}}))


if __name__ == "__main__":
    main()
