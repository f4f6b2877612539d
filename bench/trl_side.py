"""The TRL side of ``bench_vs_trl.py``: ``GRPOTrainer`` on the shared workload, run in the bench-only venv.

    .bench/trl-venv/bin/python bench/trl_side.py --model DIR --data rows.jsonl --steps 6 --out trl.json

HF ``generate`` rollout (TRL's default without vLLM), one process, ``--threads`` torch threads. Writes one
JSON object: per-step seconds, tokens (prompt + completion, valid only), mean reward, and the peak RSS.
Imports neither the platform nor Ray: only TRL's stack and ``bench/trl_workload.py``.
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

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation, reference, loss and backward all happen inside)."""

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append({"seconds": time.perf_counter() - self.start})

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any):
            if logs and steps and "reward" in logs:
                steps[-1].update({"reward": float(logs["reward"]), "num_tokens": float(logs.get("num_tokens", 0))})

    config = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-out"),
        per_device_train_batch_size=args.prompts * args.n,  # 32 completions = 8 prompts x 4 per step
        gradient_accumulation_steps=1,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
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
        reward_funcs=trl_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
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
        "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
