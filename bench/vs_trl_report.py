"""The printed report of ``bench_vs_trl.py``: the side-by-side table, the per-stage table against the matmul peak,
each variant's peak RSS per stage, and the per-step reward curves with their noise statement (Markdown)."""

from __future__ import annotations

from typing import Any


def print_report(
    trl: dict[str, Any] | None,
    plat: dict[str, Any],
    peak: dict[str, float],
    flops: dict[str, float],
    tiny: dict[str, float] | None,
    labels: dict[str, str],
) -> None:
    print("\n| side | settings | s/step (median) | tokens/s | peak RSS / process |")
    print("|---|---|---|---|---|")
    if trl is not None:
        trl_cells = f"{trl['s_per_step']:.1f} | {trl['tokens_per_s']:.0f} | {trl['peak_rss_gb']:.2f} GB"
        print(f"| TRL | {labels['trl']} | {trl_cells} |")
    print(
        f"| rlhf train | {labels['platform']} | {plat['s_per_step']:.1f} | {plat['tokens_per_s']:.0f} | "
        f"{plat['peak_rss_gb']:.2f} GB |"
    )
    if trl is not None:
        print(f"\nratio (platform / TRL tokens/s): {plat['tokens_per_s'] / trl['tokens_per_s']:.2f}x")
    print(f"\nmatmul peak here: fp32 {peak['float32']:.0f} GFLOP/s, bf16 {peak['bfloat16']:.0f} GFLOP/s")
    print("\n| stage | GFLOP | time (s) | fp32 bound (s) | bf16 bound (s) | fraction of fp32 peak | of bf16 peak |")
    print("|---|---|---|---|---|---|---|")
    for stage, seconds in plat["stages"].items():
        work = flops.get(stage)
        if work is None:
            print(f"| {stage} | | {seconds:.2f} | | | | |")
            continue
        g32, g16 = work / peak["float32"] / 1e9, work / peak["bfloat16"] / 1e9
        print(
            f"| {stage} | {work / 1e9:.0f} | {seconds:.2f} | {g32:.2f} | {g16:.2f} | "
            f"{g32 / max(seconds, 1e-9):.0%} | {g16 / max(seconds, 1e-9):.0%} |"
        )
    total = sum(flops.values())
    print(
        f"| step (sum) | {total / 1e9:.0f} | {plat['s_per_step']:.2f} | {total / peak['float32'] / 1e9:.2f} | "
        f"{total / peak['bfloat16'] / 1e9:.2f} | | |"
    )
    if trl is not None:
        print(f"\nreward per step  TRL: {[round(r, 3) for r in trl['reward']]}")
    print(f"reward per step rlhf: {[round(r, 3) for r in plat['reward']]}")
    if tiny is not None:
        print(
            f"\ntiny-cpu: {tiny['s_per_step']:.3f} s/step, overhead beyond the workers' compute "
            f"{tiny['overhead_s']:.3f} s/step"
        )


def print_stage_rss(variants: dict[str, dict[str, Any]], trl: dict[str, Any] | None) -> None:
    """Peak RSS per variant: the process's high-water mark and each stage's sampled peak (GiB)."""
    stages = sorted({k for v in variants.values() for k in v["stage_peak_rss_gb"]})
    print("\n| variant | peak RSS (ru_maxrss) | " + " | ".join(stages) + " |")
    print("|---|---|" + "---|" * len(stages))
    for name, v in variants.items():
        cells = " | ".join(f"{v['stage_peak_rss_gb'].get(k, float('nan')):.2f}" for k in stages)
        print(f"| {name} | {v['peak_rss_gb']:.2f} | {cells} |")
    if trl is not None:
        print(f"| TRL | {trl['peak_rss_gb']:.2f} |" + " |" * len(stages))


def reward_noise(base: list[float], other: list[float], *, samples: int) -> dict[str, float]:
    """Per-step reward means of two runs: mean |difference| against the per-step standard error of the difference.

    Rewards are 0/1, so a step's mean over ``samples`` samples has variance ``p (1 - p) / samples``; the two runs
    are treated as independent (their samples share seeds, so this over-states the noise a little). ``mean_diff``
    is the difference of the whole-run means, ``mean_diff_se`` its standard error.
    """
    pairs = list(zip(base, other, strict=False))
    se = [((a * (1 - a) + b * (1 - b)) / samples) ** 0.5 for a, b in pairs]
    n = max(len(pairs), 1)
    return {
        "steps": float(len(pairs)),
        "mean_abs_diff": sum(abs(b - a) for a, b in pairs) / n,
        "mean_step_se": sum(se) / n,
        "mean_diff": sum(b - a for a, b in pairs) / n,
        "mean_diff_se": sum(x * x for x in se) ** 0.5 / n,
    }


def print_reward_curves(variants: dict[str, dict[str, Any]], *, samples: int) -> dict[str, dict[str, float]]:
    """Side-by-side per-step reward means (Markdown) and each variant's noise statement against the first."""
    names = list(variants)
    curves = {n: variants[n]["reward"] for n in names}
    print("\n| step | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for i in range(max(len(c) for c in curves.values())):
        cells = " | ".join(f"{curves[n][i]:.3f}" if i < len(curves[n]) else "" for n in names)
        print(f"| {i + 1} | {cells} |")
    print("| mean | " + " | ".join(f"{sum(c) / max(len(c), 1):.3f}" for c in curves.values()) + " |")
    noise = {}
    for name in names[1:]:
        noise[name] = stats = reward_noise(curves[names[0]], curves[name], samples=samples)
        verdict = "within" if stats["mean_abs_diff"] <= stats["mean_step_se"] else "beyond"
        print(
            f"{name} vs {names[0]} over {stats['steps']:.0f} steps: mean |per-step difference| "
            f"{stats['mean_abs_diff']:.3f} vs a per-step standard error of the difference of "
            f"{stats['mean_step_se']:.3f} ({verdict} noise); whole-run means differ by {stats['mean_diff']:+.3f} "
            f"+- {stats['mean_diff_se']:.3f} (1 SE)"
        )
    return noise
