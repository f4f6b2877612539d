"""How likely is a model to open its answer with a calculator call? Teacher-forced log-probs, no generation.

Usage (light: one HF forward per prompt and variant, ~1 minute of CPU for SmolLM2-135M)::

    .venv/bin/python scripts/tool_call_probe.py [--model builtin:smollm2-135m-instruct] [--prompts 12]

For each tool-prompt variant and the first ``--prompts`` held-out ``gsm8k_synth`` questions, the probability that
the model's first turn starts with ``<tool_call>{"name": "calculator", "arguments": {"expression": "`` (the
call up to the expression) given the prompt, at temperature 1, and the per-token log-probs of that prefix
(where the probability mass goes). Variants: ``schemas`` and ``example`` are ``rollout.multi_turn.tool_prompt``
(through the same prompt encoding as training); ``two_examples`` adds a second worked call; ``example+hint``
appends "Use the calculator tool." to the question. A rate this low (1e-4 per sample) means sampled rollouts of a
few hundred samples will almost never contain a call for RL to reinforce.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = '<tool_call>{"name": "calculator", "arguments": {"expression": "'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=12)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_ops.agent.calculator import CalculatorTool
    from rlhf_ops.agent.chat_format import encode_chat_prompt
    from rlhf_ops.agent.tools import ToolExample
    from rlhf_ops.data.gsm8k_synth import make_gsm8k_synth
    from rlhf_ops.models.resolve import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    calc = CalculatorTool()
    schemas = [calc.schema()]
    second = ToolExample(
        name="calculator",
        question="Ben has 15 cards. He gives 6 to Sam. How many cards does Ben have left?",
        arguments={"expression": "15 - 6"},
        result="9",
        answer="Ben has 15 - 6 = 9 cards left.",
    )
    variants = {
        "schemas": ([], ""),
        "example": ([calc.example()], ""),
        "two_examples": ([calc.example(), second], ""),
        "example+hint": ([calc.example()], "\nUse the calculator tool."),
    }
    target = tokenizer(TARGET, add_special_tokens=False)["input_ids"]
    rows = make_gsm8k_synth("test", num_rows=args.prompts, seed=0)
    for name, (examples, hint) in variants.items():
        per_token = torch.zeros(len(target))
        probabilities = []
        for row in rows:
            messages = [{"role": "user", "content": row["prompt"][0]["content"] + hint}]
            prompt = encode_chat_prompt(tokenizer, messages, schemas, examples)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1].float()
            token_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(target)[:, None])[:, 0]
            per_token += token_lp / len(rows)
            probabilities.append(math.exp(float(token_lp.sum())))
        weakest = sorted(zip(per_token.tolist(), target, strict=True))[:3]
        print(
            json.dumps(
                {
                    "variant": name,
                    "p_call_prefix_mean": f"{sum(probabilities) / len(probabilities):.2e}",
                    "p_first_token_geomean": round(math.exp(per_token[0].item()), 4),
                    "weakest_tokens": [(tokenizer.decode([t]), round(lp, 2)) for lp, t in weakest],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
