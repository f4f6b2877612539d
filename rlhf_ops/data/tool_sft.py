"""``builtin:calculator_sft``: synthetic tool-call transcripts for an SFT warm-up before multi-turn RL.

Each row is one OpenAI-style conversation ``{"messages": [...]}`` in exactly the agent loop's layout
(:mod:`rlhf_ops.agent.chat_format`): the user turn is a ``builtin:gsm8k_synth`` prompt (question and
instruction, the RL prompt's text), the first assistant turn is one calculator call
``<tool_call>{"name": "calculator", "arguments": {"expression": "(7 + 5) - 3"}}</tool_call>`` (the same JSON
layout as :func:`rlhf_ops.agent.chat_format.example_messages`), a ``tool`` message holds the real calculator's
output, and the last assistant turn ends on the number after ``####`` (what ``gsm8k`` / ``gsm8k_flexible`` read).
The tool description (system message, worked example) is *not* in the rows: the SFT trainer adds it from
``sft.data.tools`` / ``sft.data.tool_prompt`` through the same code the rollout uses, so SFT and RL token
layouts are identical by construction.

Questions come from the ``train`` split of :mod:`rlhf_ops.data.gsm8k_synth` (disjoint by hash from the
held-out ``gsm8k_synth_test`` for any seed), drawn with a seed of their own (:data:`SEED_OFFSET` added), so
the transcripts are not the RL run's first training prompts either.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlhf_ops.agent.calculator import CalculatorTool
from rlhf_ops.agent.chat_format import OPEN_TAG
from rlhf_ops.agent.tools import SampleState
from rlhf_ops.data.gsm8k_synth import make_gsm8k_synth

CALCULATOR_SFT_SOURCE = "calculator_sft"
SEED_OFFSET = 100_003  # questions drawn apart from `builtin:gsm8k_synth`'s own seeds (0, 1, ...)
_NOTE = re.compile(r"<<([^=>]+)=(-?\d+)>>")  # gsm8k_synth's calculator notes: <<7+5=12>>
_OPERATOR = re.compile(r"\s*([-+*/])\s*")


def _spaced(expression: str) -> str:
    """``"7+5"`` -> ``"7 + 5"`` (the notes are written without spaces)."""
    return _OPERATOR.sub(r" \1 ", expression).strip()


def solution_expression(solution: str) -> str:
    """One arithmetic expression for a worked gsm8k_synth solution: its steps nested into one.

    A second step uses the first step's value as an operand (``12 - 3`` after ``7 + 5 = 12``); that operand is
    replaced with the first step in parentheses (``(7 + 5) - 3``). Which occurrence is replaced does not matter:
    they are equal numbers.

    Raises:
        ValueError: if the solution has no ``<<expr=value>>`` note or a later step does not use the value before.
    """
    notes = _NOTE.findall(solution)
    if not notes:
        raise ValueError(f"no <<expression=value>> note in the solution {solution!r}")
    expression, value = _spaced(notes[0][0]), notes[0][1]
    for step, step_value in notes[1:]:
        operands = re.split(r"\s*[-+*/]\s*", step)
        if value not in operands:
            raise ValueError(f"step {step!r} does not use the previous value {value}")
        spaced = _spaced(step)
        expression = re.sub(rf"(?<![\d.]){re.escape(value)}(?![\d.])", f"({expression})", spaced, count=1)
        value = step_value
    return expression


def calculator_call(expression: str) -> str:
    """The assistant turn that calls the calculator (the worked example's JSON layout)."""
    call = json.dumps({"name": CalculatorTool.name, "arguments": {"expression": expression}})
    return f"{OPEN_TAG}{call}</tool_call>"


def final_answer(expression: str, result: str) -> str:
    """The assistant turn after the tool result: the computation, then ``#### N`` (the instruction's format)."""
    return f"{expression} = {result}\n#### {result}"


def make_calculator_transcripts(num_rows: int, *, seed: int) -> list[dict[str, Any]]:
    """``num_rows`` conversations: question, calculator call, the calculator's result, final answer.

    Args:
        num_rows: Number of conversations (1..``gsm8k_synth.MAX_ROWS``).
        seed: Seed; questions are ``gsm8k_synth`` train rows drawn with ``seed + SEED_OFFSET``.

    Returns:
        Rows ``{"messages": [user, assistant, tool, assistant], "ground_truth": "9", "question": ...}``.

    Raises:
        ValueError: on ``num_rows`` out of range.
    """
    tool = CalculatorTool()
    rows = []
    for problem in make_gsm8k_synth("train", num_rows=num_rows, seed=seed + SEED_OFFSET):
        info, truth = problem["extra_info"], problem["reward_model"]["ground_truth"]
        expression = solution_expression(info["answer"])
        result = tool.call({"expression": expression}, SampleState(index=0))
        assert result == truth, f"calculator gives {result} for {expression!r}, the problem's answer is {truth}"
        rows.append(
            {
                "messages": [
                    *problem["prompt"],
                    {"role": "assistant", "content": calculator_call(expression)},
                    {"role": "tool", "content": result},
                    {"role": "assistant", "content": final_answer(expression, result)},
                ],
                "ground_truth": truth,
                "question": info["question"],
            }
        )
    return rows
