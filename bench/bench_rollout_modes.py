"""Benchmark: sync rollout vs async rollout vs one-step off-policy pipelining, same model and workload, one run.

Run (from the repository root; HEAVY: three training runs, each with its own local Ray cluster)::

    flock /tmp/rlhf-test.lock .venv/bin/python bench/bench_rollout_modes.py                 # tiny model
    flock /tmp/rlhf-test.lock .venv/bin/python bench/bench_rollout_modes.py \\
        --model builtin:smollm2-135m-instruct --steps 3                                     # SmolLM2-135M

Modes (every one a vLLM engine per rank, 2 FSDP2 ranks, the same prompts, seeds, sampling and lengths):

- ``sync``: ``rollout.mode=sync`` (the in-process ``vllm.LLM``), generate then train: the baseline.
- ``async``: ``rollout.mode=async`` (``AsyncLLM``, engine core in its own process, one request per sample).
- ``one_step_off``: async + ``trainer.pipeline=one_step_off`` (step k + 1's batch generated while step k trains)
  + ``algorithm.rollout_correction.rollout_is=token``.

Each mode runs ``--steps`` steps through the real entrypoint (``python -m workers.entrypoints.train``) in a
subprocess; the first step is dropped (engine warm-up; one_step_off's first step is synchronous). Reported per
mode, means over the remaining steps:

- ``rollout tok/s``: generated tokens / the engines' generation seconds (``timing_s/worker/generate_sequences``,
  rank 0; for one_step_off measured while the step before trained, so it includes that contention);
- ``step tok/s``: generated tokens / the step's wall time (``perf/time_per_step``): the end-to-end figure the
  pipelining is for; ``s/step`` and ``wait s`` (``timing_s/gen``: how long the step waited for its batch);

with both ratios against ``sync`` measured in the same run. On a CPU machine the engine-core processes and the
FSDP ranks share the same cores: the overlap only wins the time one side leaves the cores idle (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = "builtin:tiny-llama"
MODES: dict[str, list[str]] = {
    "sync": ["rollout.mode=sync"],
    "async": ["rollout.mode=async"],
    "one_step_off": [
        "rollout.mode=async",
        "trainer.pipeline=one_step_off",
        "algorithm.rollout_correction.rollout_is=token",
    ],
}


def _workload(model: str, steps: int, max_new_tokens: int | None) -> tuple[str, list[str]]:
    """The preset and overrides shared by every mode."""
    common = [
        f"model.path={model}",
        "rollout.engine=vllm",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=100",
        "trainer.save_freq=0",  # the loop still saves the last step: removed after reading the metrics
        "trainer.save_hf_model=false",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.resume_mode=disable",
        "data.val_files=[]",
    ]
    if model == TINY:  # 16 prompts x 16 samples, responses up to 32 tokens (the random model rarely stops early)
        tokens = max_new_tokens or 32
        return "tiny-cpu", [*common, f"rollout.max_new_tokens={tokens}", "rollout.kv_cache_memory_bytes=67108864"]
    tokens = max_new_tokens or 96  # the preset's 8 prompts x 4 samples, up to 96 tokens
    return "smollm2-135m-grpo-cpu", [*common, f"rollout.max_new_tokens={tokens}"]


def _run_mode(mode: str, preset: str, overrides: list[str], root: Path, timeout_s: float) -> list[dict[str, Any]]:
    out = root / mode
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "workers.entrypoints.train", "--preset", preset, *overrides, *MODES[mode]]
    cmd += [f"trainer.checkpoint_root={out}", "trainer.experiment_name=bench", f"trainer.run_name={mode}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)})
    log = out / "train.log"
    start = time.perf_counter()
    with log.open("wb") as sink:
        rc = subprocess.run(
            cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
        ).returncode
    if rc != 0:
        raise SystemExit(f"{mode}: training exited {rc}; log {log}:\n{log.read_text(errors='replace')[-3000:]}")
    run_dir = out / "bench" / mode
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    for ckpt in run_dir.glob("global_step_*"):  # SmolLM2: ~1.6 GB of model + optimizer shards per mode
        shutil.rmtree(ckpt)
    print(
        f"{mode}: {len(rows)} steps in {time.perf_counter() - start:.0f} s (with Ray and engine start-up)", flush=True
    )
    return rows


def _summary(rows: list[dict[str, Any]], rows_per_step: int) -> dict[str, float]:
    steady = rows[1:] or rows  # step 1: engine warm-up (one_step_off: generated synchronously)
    generated = [r["response_length/mean"] * rows_per_step for r in steady]
    return {
        "rollout_tok_s": sum(generated) / sum(r["timing_s/worker/generate_sequences"] for r in steady),
        "step_tok_s": sum(generated) / sum(r["perf/time_per_step"] for r in steady),
        "s_per_step": statistics.mean(r["perf/time_per_step"] for r in steady),
        "wait_s": statistics.mean(r["timing_s/gen"] for r in steady),
        "gen_tokens": statistics.mean(generated),
        "policy_lag": statistics.mean(r.get("training/policy_lag", 0.0) for r in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TINY, help=f"{TINY} (default) or builtin:smollm2-135m-instruct / a path")
    parser.add_argument("--steps", type=int, default=6, help="steps per mode (the first is dropped)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per mode")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is dropped)")
    if args.modes[0] != "sync":
        raise SystemExit("--modes must start with sync: the ratios are against it")
    sys.path.insert(0, str(REPO))
    from rlhf_ops.config import load_config

    preset, overrides = _workload(args.model, args.steps, args.max_new_tokens)
    config = load_config(preset, [*overrides, *MODES["one_step_off"]])  # pre-flight of the strictest mode
    rows_per_step = config.data.train_batch_size * config.rollout.n
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_rollout_modes_"))
    print(
        f"workload: {preset} model={args.model} {rows_per_step} samples/step (prompts x n), up to "
        f"{config.rollout.max_new_tokens} new tokens, {args.steps} steps/mode; runs under {root}",
        flush=True,
    )
    results = {
        mode: _summary(_run_mode(mode, preset, overrides, root, args.timeout_s), rows_per_step) for mode in args.modes
    }
    base = results["sync"]
    print(f"{'mode':<14}{'rollout tok/s':>14}{'x sync':>8}{'step tok/s':>12}{'x sync':>8}", end="")
    print(f"{'s/step':>9}{'wait s':>8}{'lag':>5}")
    for mode, r in results.items():
        print(
            f"{mode:<14}{r['rollout_tok_s']:>14.1f}{r['rollout_tok_s'] / base['rollout_tok_s']:>8.2f}"
            f"{r['step_tok_s']:>12.1f}{r['step_tok_s'] / base['step_tok_s']:>8.2f}{r['s_per_step']:>9.2f}"
            f"{r['wait_s']:>8.2f}{r['policy_lag']:>5.1f}"
        )
    (root / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"summary: {root / 'summary.json'}")


if __name__ == "__main__":
    main()
