"""Learning per wall-clock: TRL's ``GRPOTrainer`` and ``rlhf train`` each train SmolLM2-135M-Instruct from the same
base model for the same wall-clock budget on the same host; both results, and the base, are then scored greedily on
the same held-out prompts, with paired intervals.

    flock /tmp/rlhf-heavy.lock .venv/bin/python bench/learning_vs_trl.py --minutes 30 --heldout 400 \\
        --out outputs/learning_vs_trl

Recipe, both sides: the ``smollm2-135m-grpo-cpu`` preset's (``builtin:gsm8k_synth``, 4000 rows of seed 1, 4 prompts
x 8 samples a step, temperature 0.7, 64 new tokens, lr 1e-5 constant, k3 KL loss 0.04, token-mean loss, grad clip
1.0, fp32, 2 threads, reward ``gsm8k_flexible``). Each side's tool is its own: TRL generates with HF ``generate``
(its default without a vLLM server), the platform with vLLM and its preset's layout. The budget counts from each
training process's start (start-up included) and ends both runs by the same rule: after a step, stop when one more
step as long as the slowest of the last three would overrun (``trainer.early_stop.max_time_s`` on the platform, the
same rule as a callback in TRL); saving the final model comes on top on both sides.

Held-out: ``builtin:gsm8k_synth_test`` (disjoint from the training split), greedy, 96 new tokens, vLLM, the same
``rlhf eval model`` for all three models. Writes into ``--out``: ``base.json`` / ``trl.json`` / ``platform.json``
(per-prompt results; ``base.json`` is reused when present), ``gain_*.json`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))
from bench_vs_trl import ensure_trl_venv, host_kind, platform_env  # noqa: E402

PRESET = "smollm2-135m-grpo-cpu"
EVAL_ARGS = [
    "--data",
    "builtin:gsm8k_synth_test",
    "--reward-fn",
    "gsm8k_flexible",
    "--max-new-tokens",
    "96",
    "--max-prompt-length",
    "160",
    "--engine",
    "vllm",
]


def train_rows(path: Path) -> Path:
    """The preset's training rows (``data.toy_rows`` of ``builtin:gsm8k_synth`` with ``trainer.seed``) as JSONL."""
    from rlhf_ops.config import load_config
    from rlhf_ops.data.toy_tasks import make_toy_dataset

    config = load_config(PRESET, [])
    rows = make_toy_dataset("gsm8k_synth", num_rows=config.data.toy_rows, seed=config.trainer.seed)
    lines = [json.dumps({"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]}) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def run(cmd: list[str], *, log: Path, env: dict[str, str]) -> float:
    """Runs ``cmd`` (output to ``log``), raising on failure; returns its wall seconds."""
    started = time.time()
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed (exit {done.returncode}); see {log}")
    return time.time() - started


def evaluate(model: str, out: Path, *, prompts: int, env: dict[str, str]) -> dict[str, Any]:
    if not out.exists():
        cmd = [str(REPO / ".venv/bin/rlhf"), "eval", "model", model, *EVAL_ARGS, "--max-prompts", str(prompts)]
        run([*cmd, "--out", str(out)], log=out.with_suffix(".log"), env=env)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def gain(before: Path, after: Path, out: Path, *, env: dict[str, str]) -> dict[str, Any]:
    cmd = [str(REPO / ".venv/bin/rlhf"), "eval", "gain", str(before), str(after), "--out", str(out)]
    run(cmd, log=out.with_suffix(".log"), env=env)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def train_trl(out: Path, *, rows: Path, model_dir: str, budget_s: float, threads: int) -> dict[str, Any]:
    python = ensure_trl_venv()
    cmd = [str(python), str(REPO / "bench" / "trl_side.py"), "--model", model_dir, "--data", str(rows)]
    cmd += ["--steps", "1000", "--prompts", "4", "--n", "8", "--max-new-tokens", "64", "--temperature", "0.7"]
    cmd += ["--lr", "1e-5", "--beta", "0.04", "--reward", "gsm8k_flexible", "--threads", str(threads)]
    cmd += ["--max-time-s", str(budget_s), "--save-model", str(out / "trl-model")]
    cmd += ["--out", str(out / "trl_train.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    wall = run(cmd, log=out / "trl_train.log", env=env)
    result: dict[str, Any] = json.loads((out / "trl_train.json").read_text())
    result["wall_s"] = wall
    return result


def train_platform(out: Path, *, budget_s: float, threads: int) -> tuple[dict[str, Any], str]:
    root = out / "checkpoints"
    cmd = [str(REPO / ".venv/bin/rlhf"), "train", "--preset", PRESET, "trainer.total_training_steps=1000"]
    cmd += [f"trainer.early_stop.max_time_s={budget_s}", "trainer.save_freq=0", f"trainer.checkpoint_root={root}"]
    cmd += ["trainer.run_name=wallclock", "trainer.resume_mode=disable", "trainer.logger=[console,jsonl]"]
    wall = run(cmd, log=out / "platform_train.log", env=platform_env(threads))
    run_dir = root / PRESET / "wallclock"
    outcome: dict[str, Any] = json.loads((run_dir / "outcome.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    outcome["wall_s"] = wall
    outcome["trained_s"] = records[-1].get("training/wall_clock_s")
    outcome["steps"] = [
        {"step": r["step"], "reward": r.get("critic/score/mean"), "wall_clock_s": r.get("training/wall_clock_s")}
        for r in records
    ]
    return outcome, str(run_dir / f"global_step_{outcome['step']}" / "hf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of each side's training")
    parser.add_argument("--heldout", type=int, default=400, help="held-out prompts scored greedily")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--out", default="outputs/learning_vs_trl")
    parser.add_argument("--sides", default="trl,platform", help="comma list of the sides to (re)train")
    args = parser.parse_args()

    from rlhf_ops.models.resolve import resolve_model_path

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget_s = args.minutes * 60.0
    model_dir = str(resolve_model_path(args.model))
    env = platform_env(args.threads)
    rows = train_rows(out / "train_rows.jsonl")
    summary: dict[str, Any] = {"host": host_kind(), "budget_s": budget_s, "heldout": args.heldout}
    summary["started"] = time.ctime()
    sides = args.sides.split(",")
    evaluate(model_dir, out / "base.json", prompts=args.heldout, env=env)
    if "trl" in sides:
        (out / "trl.json").unlink(missing_ok=True)
        summary["trl"] = train_trl(out, rows=rows, model_dir=model_dir, budget_s=budget_s, threads=args.threads)
        (out / "trl_summary.json").write_text(json.dumps(summary["trl"], indent=1))
    if "platform" in sides:
        (out / "platform.json").unlink(missing_ok=True)
        summary["platform"], hf_dir = train_platform(out, budget_s=budget_s, threads=args.threads)
        (out / "platform_hf_dir.txt").write_text(hf_dir)
        (out / "platform_summary.json").write_text(json.dumps(summary["platform"], indent=1))
    for side in ("trl", "platform"):  # a side not retrained this time: its earlier run
        if side not in summary and (out / f"{side}_summary.json").exists():
            summary[side] = json.loads((out / f"{side}_summary.json").read_text())
    evaluate(str(out / "trl-model"), out / "trl.json", prompts=args.heldout, env=env)
    evaluate((out / "platform_hf_dir.txt").read_text(), out / "platform.json", prompts=args.heldout, env=env)
    for name, (before, after) in {
        "trl": ("base", "trl"),
        "platform": ("base", "platform"),
        "platform_vs_trl": ("trl", "platform"),
    }.items():
        reports = (out / f"{before}.json", out / f"{after}.json")
        summary[f"gain_{name}"] = gain(*reports, out / f"gain_{name}.json", env=env)
    summary["finished"] = time.ctime()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k.startswith("gain_") or k == "host"}, indent=1))


if __name__ == "__main__":
    main()
