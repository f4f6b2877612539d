"""Held-out accuracy and tool-call rate of a model run through the agent loop (multi-turn, tools), greedy.

Usage (HEAVY: one vLLM engine; run it under the machine's lock)::

    .venv/bin/python scripts/multi_turn_eval.py MODEL_DIR --out before.json [--max-prompts 200] \\
        [--preset smollm2-135m-grpo-cpu] [overrides ...]

The prompts, tools, tool prompt, turn limits and response budget are the training run's: ``--preset`` plus the
same dotted overrides (e.g. ``rollout.multi_turn.enable=true 'rollout.multi_turn.tools=[calculator]'
rollout.multi_turn.tool_prompt=example rollout.max_new_tokens=160 data.max_prompt_length=512``); the data is
``--data`` (default ``builtin:gsm8k_synth_test``), the first ``--max-prompts`` prompts. The engine is the
in-process vLLM (``VLLMRollout``) with the agent loop in rounds (``MultiTurnRollout``), greedy, and the score is
the run's reward function on the whole response (model and tool tokens, as in training).

The report holds ``metrics`` (``eval/acc``, ``eval/tool_call_rate``: the share of prompts whose response made at
least one tool call, ``eval/tool_calls_mean``, ``eval/turns_mean``, ``eval/truncated_rate``...), ``per_prompt``
(``index``, ``score``, ``correct``, ``tool_calls``...) and ``examples``; ``rlhf eval gain before.json after.json``
pairs two of them (same ``--data`` and prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an HF model folder or a builtin: model")
    parser.add_argument("--out", required=True, help="report JSON")
    parser.add_argument("--preset", default="smollm2-135m-grpo-cpu")
    parser.add_argument("--data", default="builtin:gsm8k_synth_test")
    parser.add_argument("--max-prompts", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100, help="prompts per engine call")
    parser.add_argument("--examples", type=int, default=8, help="responses kept in the report")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="hf: transformers, slow (checks)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the training run")
    args = parser.parse_intermixed_args()  # overrides may follow the options
    if args.max_prompts < 1 or args.batch < 1:
        raise SystemExit("--max-prompts and --batch must be >= 1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(REPO))
    from rlhf_ops.agent.tools import tool_examples
    from rlhf_ops.config import load_config
    from rlhf_ops.data.dataset import PromptDataset
    from rlhf_ops.data.images import load_tokenizer_or_processor
    from rlhf_ops.models.generation import eos_token_ids
    from rlhf_ops.models.resolve import resolve_model_path
    from rlhf_ops.rewards import load_reward_fn
    from workers.rollout.multi_turn import MultiTurnRollout, build_tools
    from workers.rollout.vllm_rollout import VLLMRollout

    config = load_config(args.preset, args.overrides)
    multi_turn = config.rollout.multi_turn
    if not multi_turn.enable:
        raise SystemExit("rollout.multi_turn.enable is false: pass the run's multi-turn overrides (see --help)")
    tools = build_tools(multi_turn)  # what training describes (workers/entrypoints/train.py)
    examples = tool_examples(tools) if multi_turn.tool_prompt == "example" else []
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer_or_processor(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = PromptDataset.from_sources(
        [args.data],
        tokenizer,
        max_prompt_length=config.data.max_prompt_length,
        prompt_key=config.data.prompt_key,
        ground_truth_key=config.data.ground_truth_key,
        data_source_key=config.data.data_source_key,
        apply_chat_template=config.data.apply_chat_template,
        toy_rows=max(args.max_prompts, config.data.toy_rows),
        seed=0,
        tools=[tool.schema() for tool in tools.values()],
        tool_examples=examples,
    )
    indices = list(range(min(args.max_prompts, len(data))))
    response_length = config.rollout.max_new_tokens
    engine: Any
    if args.engine == "hf":
        import torch
        from transformers import AutoModelForCausalLM

        from workers.rollout.hf_rollout import HFRollout

        module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine = HFRollout(
            module,
            pad_token_id=int(tokenizer.pad_token_id),
            eos_token_id=eos_token_ids(path, tokenizer),
            response_length=response_length,
        )
    else:
        engine = VLLMRollout(
            path,
            config=config.rollout.model_copy(update={"engine": "vllm", "mode": "sync"}),
            pad_token_id=int(tokenizer.pad_token_id),
            eos_token_id=eos_token_ids(path, tokenizer),
            seed=0,
            device="cpu",
            max_prompt_length=config.data.max_prompt_length,
        )
    rollout = MultiTurnRollout(engine, multi_turn, tokenizer=tokenizer)
    if config.reward.reward_fn is None:
        raise SystemExit("reward.reward_fn is not set: the evaluation scores with the run's rule reward; set it")
    score_fn = load_reward_fn(config.reward.reward_fn)
    greedy = dataclasses.replace(engine.defaults, n=1, do_sample=False)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        for first in range(0, len(indices), args.batch):
            chunk = indices[first : first + args.batch]
            out = rollout.generate_sequences(
                data.batch(chunk, pad_token_id=int(tokenizer.pad_token_id), uid_prefix="e"), greedy
            )
            assert out.batch is not None
            b = out.batch
            attended = b["attention_mask"][:, -response_length:].sum(-1)
            for row, index in enumerate(chunk):
                text = tokenizer.decode(b["responses"][row, : int(attended[row])].tolist(), skip_special_tokens=True)
                result = score_fn(data.data_sources[index], text, data.ground_truths[index], None)
                score = float(result["score"]) if isinstance(result, dict) else float(result)
                correct = float(result.get("acc", score >= 1.0)) if isinstance(result, dict) else float(score >= 1.0)
                rows.append(
                    {
                        "index": index,
                        "score": score,
                        "correct": correct,
                        "length": int(b["response_mask"][row].sum()),
                        "observation_tokens": int(attended[row] - b["response_mask"][row].sum()),
                        "tool_calls": int(b["tool_call_counts"][row]),
                        "tool_errors": int(b["tool_errors"][row]),
                        "turns": int(b["num_turns"][row]),
                        "truncated": int(b["truncated"][row]),
                        "ground_truth": data.ground_truths[index],
                        "response": text,
                    }
                )
            print(f"{len(rows)}/{len(indices)} prompts, {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        if args.engine == "vllm":
            engine.shutdown()
    n = len(rows)
    calling = sum(r["tool_calls"] > 0 for r in rows)
    metrics = {
        "eval/acc": sum(r["correct"] for r in rows) / n,
        "eval/tool_call_rate": calling / n,
        "eval/tool_calls_mean": sum(r["tool_calls"] for r in rows) / n,
        "eval/tool_errors": float(sum(r["tool_errors"] for r in rows)),
        "eval/turns_mean": sum(r["turns"] for r in rows) / n,
        "eval/truncated_rate": sum(r["truncated"] for r in rows) / n,
        "eval/response_length_mean": sum(r["length"] for r in rows) / n,
        "eval/acc_when_calling": (sum(r["correct"] for r in rows if r["tool_calls"]) / calling) if calling else None,
    }
    report = {
        "version": 1,
        "model_dir": str(path),
        "data_files": [args.data],
        "settings": {"preset": args.preset, "overrides": args.overrides, "greedy": True, "engine": args.engine},
        "metrics": metrics,
        "examples": [{k: r[k] for k in ("index", "ground_truth", "response", "correct", "tool_calls")} for r in rows][
            : args.examples
        ],
        "per_prompt": [{k: v for k, v in r.items() if k not in ("response", "ground_truth")} for r in rows],
        "seconds": time.perf_counter() - start,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()}
    print(f"{args.model}: {n} prompts, {calling} with a tool call: {json.dumps(summary)} -> {args.out}")


if __name__ == "__main__":
    main()
