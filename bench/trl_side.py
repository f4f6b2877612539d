"""The TRL side of ``bench_vs_trl.py`` and ``learning_vs_trl.py``: ``GRPOTrainer`` on a shared workload, run in the
bench-only venv.

    .bench/trl-venv/bin/python bench/trl_side.py --model DIR --data rows.jsonl --steps 6 --out trl.json

HF ``generate`` rollout (TRL's default without vLLM), one process, ``--threads`` torch threads. Writes one
JSON object: per-step seconds, tokens (prompt + completion, valid only), mean reward, and the peak RSS.
``--max-time-s`` ends training by the platform's ``trainer.early_stop.max_time_s`` rule (from the process start:
stop after a step when one more as long as the slowest of the last three would overrun); ``--save-model`` writes
the trained model. Imports neither Ray nor the platform's trainer: TRL's stack, ``bench/trl_workload.py`` and, for
``--reward gsm8k_flexible``, the platform's torch-free reward module.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_workload import trl_reward  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--reward", choices=["bench_add", "gsm8k_flexible"], default="bench_add")
    parser.add_argument("--max-time-s", type=float, default=None, help="wall-clock budget from the process start")
    parser.add_argument("--save-model", default=None, help="folder for the trained model and its tokenizer")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (transformers Trainer on CPU)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")

    steps: list[dict[str, float]] = []
    started = process_start()

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, reference, loss and backward all happen inside)."""

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, _args: Any, _state: Any, control: Any, **__: Any) -> None:
            steps.append({"seconds": time.perf_counter() - self.start, "elapsed_s": time.time() - started})
            slowest = max(s["seconds"] for s in steps[-3:])
            if args.max_time_s is not None and steps[-1]["elapsed_s"] + slowest > args.max_time_s:
                control.should_training_stop = True

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any):
            if logs and steps and "reward" in logs:
                steps[-1].update({"reward": float(logs["reward"]), "num_tokens": float(logs.get("num_tokens", 0))})

    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-out"),
        per_device_train_batch_size=args.prompts * args.n,  # 32 completions = 8 prompts x 4 per step
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        beta=args.beta,  # k3 KL to the reference, as algorithm.kl_loss_type=low_var_kl
        loss_type="dapo",  # token mean over the whole batch, as loss_agg_mode=token-mean
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=args.bf16,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward if args.reward == "bench_add" else gsm8k_flexible_reward(),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    trained_s = time.time() - started
    if args.save_model:
        trainer.save_model(args.save_model)
    # num_tokens is cumulative (prompt + completion, valid tokens): per step = the difference.
    previous = 0.0
    for step in steps:
        total = step.get("num_tokens", 0.0)
        step["tokens"], previous = total - previous, total
    result = {
        "steps": steps,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "threads": args.threads,
        "bf16": args.bf16,
        "trained_s": trained_s,
        "max_time_s": args.max_time_s,
        "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


def process_start() -> float:
    import psutil

    return float(psutil.Process().create_time())


def gsm8k_flexible_reward() -> Any:
    """The platform's ``gsm8k_flexible`` score in TRL's reward signature (the module is torch- and pydantic-free)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlhf_ops.rewards.gsm8k import gsm8k_flexible_score

    def gsm8k_flexible(completions: list[Any], ground_truth: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        scores = [gsm8k_flexible_score("gsm8k_synth", t, g) for t, g in zip(texts, ground_truth, strict=True)]
        return [float(s["score"]) for s in scores]

    return gsm8k_flexible


if __name__ == "__main__":
    main()
