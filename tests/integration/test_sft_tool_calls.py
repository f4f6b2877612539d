"""Slow: a few SFT steps on calculator transcripts make SmolLM2-135M-Instruct call the calculator in the agent loop.

The base model never calls the tool (0/400 held-out prompts, README "Measured results"); after 10 optimizer steps
of ``rlhf sft`` on 40 ``builtin:calculator_sft`` transcripts, greedy answers to held-out ``gsm8k_synth_test``
prompts, run through :class:`rlhf_ops.agent.AgentLoop` (HF ``generate`` as the engine), hold well-formed calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlhf_ops.agent import AgentLoop, AgentLoopConfig, CalculatorTool, Completion, encode_chat_prompt
from rlhf_ops.agent.chat_format import parse_tool_calls
from rlhf_ops.agent.tools import tool_examples
from rlhf_ops.data.gsm8k_synth import make_gsm8k_synth
from tests.support.real_model import smollm2_path
from workers.entrypoints.sft import main

EOS = 2  # <|im_end|>


@pytest.mark.slow  # ~2-3 min on 2 cores: 10 SFT steps of ~400-token conversations, then 4 greedy episodes
def test_a_short_sft_warm_up_makes_smollm2_call_the_calculator(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smollm2_path()
    out = tmp_path / "sft"
    overrides = [
        "data.num_rows=40",
        "trainer.epochs=1",
        "trainer.grad_accum_steps=1",
        "optim.lr=1e-4",
        "optim.lr_warmup_steps=1",
        f"trainer.output_dir={out}",
    ]
    assert main(["--preset", "smollm2-135m-calculator-sft", *overrides]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    calculator = CalculatorTool()
    schemas, examples = [calculator.schema()], tool_examples({"calculator": calculator})
    rows = make_gsm8k_synth("test", num_rows=4, seed=0)
    prompts = [encode_chat_prompt(tokenizer, row["prompt"], schemas, examples) for row in rows]

    def generate(contexts: list[list[int]], budgets: list[int]) -> list[Completion]:
        completions = []
        for context, budget in zip(contexts, budgets, strict=True):
            ids = torch.tensor([context])
            with torch.no_grad():
                done = model.generate(ids, max_new_tokens=budget, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
            tokens = done[0, len(context) :].tolist()
            completions.append(Completion(tokens, [0.0] * len(tokens)))
        return completions

    loop = AgentLoop(
        tokenizer,
        tools={"calculator": calculator},
        config=AgentLoopConfig(max_turns=3, response_length=160),
        eos_token_ids=[EOS],
    )
    samples = loop.run(prompts, generate)
    model_texts: list[Any] = []
    for sample in samples:
        model_ids = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m]
        model_texts.append(tokenizer.decode(model_ids, skip_special_tokens=True))
    calls = [c for text in model_texts for c in parse_tool_calls(text)]
    well_formed = [c for c in calls if c.error is None and c.name == "calculator" and "expression" in c.arguments]
    assert well_formed, model_texts
    assert sum(s.state.tool_errors for s in samples) == 0, model_texts
