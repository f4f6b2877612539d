"""``builtin:calculator_sft``: each transcript's call parses, the real calculator gives the answer, the final turn
scores 1 with the RL reward, and no question is a held-out one."""

from __future__ import annotations

import pytest

from rlhf_ops.agent.calculator import evaluate
from rlhf_ops.agent.chat_format import parse_tool_calls
from rlhf_ops.data.gsm8k_synth import INSTRUCTION, make_gsm8k_synth
from rlhf_ops.data.tool_sft import make_calculator_transcripts, solution_expression
from rlhf_ops.rewards.gsm8k import gsm8k_flexible_score, gsm8k_score


@pytest.mark.parametrize(
    ("solution", "expression"),
    [
        ("Tom has 7 + 5 = <<7+5=12>>12.\n#### 12", "7 + 5"),
        # the second step uses the first step's value: nested in parentheses
        ("After buying, A has 7 + 5 = <<7+5=12>>12.\nThen 12 - 3 = <<12-3=9>>9.\n#### 9", "(7 + 5) - 3"),
        ("The boxes hold 3 * 4 = <<3*4=12>>12.\nSo B has 5 + 12 = <<5+12=17>>17.\n#### 17", "5 + (3 * 4)"),
        # an operand equal to the value: either occurrence gives the same number (12 - 12 = 0)
        ("x 6 + 6 = <<6+6=12>>12.\ny 12 - 12 = <<12-12=0>>0.\n#### 0", "(6 + 6) - 12"),
    ],
)
def test_solution_expression_nests_the_steps(solution: str, expression: str) -> None:
    assert solution_expression(solution) == expression


def test_a_solution_without_notes_is_refused() -> None:
    with pytest.raises(ValueError, match="no <<expression=value>> note"):
        solution_expression("#### 3")


def test_every_transcript_calls_the_calculator_and_ends_on_the_right_number() -> None:
    rows = make_calculator_transcripts(200, seed=3)
    assert len({r["question"] for r in rows}) == 200
    two_step = 0
    for row in rows:
        user, call, tool, answer = row["messages"]
        assert user["role"] == "user" and user["content"].endswith(INSTRUCTION)
        assert (call["role"], tool["role"], answer["role"]) == ("assistant", "tool", "assistant")
        (parsed,) = parse_tool_calls(call["content"])
        assert parsed.error is None and parsed.name == "calculator"
        assert str(evaluate(parsed.arguments["expression"])) == tool["content"] == row["ground_truth"]
        two_step += "(" in parsed.arguments["expression"]
        for score in (gsm8k_score, gsm8k_flexible_score):
            assert score("synth/gsm8k", answer["content"], row["ground_truth"])["score"] == 1.0
    assert 60 < two_step < 140  # half the templates take two steps


def test_no_transcript_question_is_held_out_or_among_the_rl_run_s_first_prompts() -> None:
    questions = {r["question"] for r in make_calculator_transcripts(1000, seed=0)}
    # scripts/multi_turn_eval.py scores the first 400 of builtin:gsm8k_synth_test (seed 0, >= 4000 rows drawn)
    held_out = {r["extra_info"]["question"] for r in make_gsm8k_synth("test", num_rows=4000, seed=0)}
    assert not questions & held_out
    # a run's train prompts (seed 1, the GRPO preset's trainer.seed) draw from the same split with another seed
    rl_first = {r["extra_info"]["question"] for r in make_gsm8k_synth("train", num_rows=80, seed=1)}
    assert len(questions & rl_first) < 10


def test_the_transcripts_are_deterministic_in_the_seed() -> None:
    assert make_calculator_transcripts(5, seed=1) == make_calculator_transcripts(5, seed=1)
    assert make_calculator_transcripts(5, seed=1) != make_calculator_transcripts(5, seed=2)
