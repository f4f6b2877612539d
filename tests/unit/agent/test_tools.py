"""The calculator, the tool registry (built-ins, dotted paths, errors naming the key) and the config rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_ops.agent import CalculatorTool, SampleState, ToolError, ToolLimits, evaluate, load_interaction, load_tools
from rlhf_ops.agent.chat_format import parse_tool_calls
from rlhf_ops.code_policy import ALLOWED_MODULES_ENV, PLATFORM_CONFIG_ENV, CodeNotAllowedError
from rlhf_ops.config.loader import load_config
from tests.support.tools import Counter


@pytest.mark.parametrize(
    ("expression", "value"),
    [("6*7", 42), ("(17 + 5) * 3", 66), ("7 / 2", 3.5), ("7 // 2", 3), ("-2 ** 2", -4), ("sqrt(16) + abs(-1)", 5)],
)
def test_calculator_values(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('ls')", "unsupported expression element"),
        ("().__class__", "unsupported expression element Attribute"),
        ("9 ** 9 ** 9", "exponent 387420489 is above 100"),
        ("1 / 0", "division by zero"),
        ("2 +", "cannot parse"),
        ("x + 1", "unsupported expression element Name"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_calculator_tool_needs_an_expression_string() -> None:
    tool = CalculatorTool()
    assert tool.call({"expression": "0.1 + 0.2"}, SampleState(index=0)) == "0.3"
    with pytest.raises(ToolError, match="'expression'"):
        tool.call({"expr": "1"}, SampleState(index=0))


def test_parse_tool_calls_reads_openai_style_string_arguments() -> None:
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    [call] = parse_tool_calls(text)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "1+1"}, None)
    assert parse_tool_calls("no calls here") == []


def test_registry_loads_builtins_and_dotted_paths_with_limits() -> None:
    limits = ToolLimits(timeout_s=1.5)
    tools = load_tools(["calculator", "tests.support.tools:Counter"], limits=limits)
    assert sorted(tools) == ["calculator", "counter"]
    counter = tools["counter"]
    assert isinstance(counter, Counter) and counter.limits is limits
    state = SampleState(index=0)
    assert [counter.call({}, state) for _ in range(2)] == ["1", "2"]  # per-sample state


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_pkg.tools:Tool", "rollout.multi_turn.tools: tool 'no_such_pkg.tools:Tool': cannot import"),
        ("tests.support.tools:Missing", "has no attribute 'Missing'"),
        ("tests.support.tools.needs_arguments", "cannot be built with no arguments"),
        ("rlhf_ops.agent.calculator:MAX_EXPONENT", "gave a int, not a tool"),
        ("python", "neither a built-in nor a dotted path"),  # supplied by the worker layer only
    ],
)
def test_registry_errors_name_the_key_and_the_fix(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_tools([spec], limits=ToolLimits())


def test_tools_and_interactions_load_only_from_the_operators_allow_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reward functions' allow-list (rlhf_ops.code_policy) guards tools and interactions too: a module
    # outside it is refused before it is imported, so its top-level code never runs.
    marker = tmp_path / "imported"
    (tmp_path / "team_tools_x.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Tool: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLATFORM_CONFIG_ENV, str(tmp_path / "no-platform.yaml"))
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "")  # built-ins only
    with pytest.raises(CodeNotAllowedError, match=r"^rollout.multi_turn.tools: tool 'team_tools_x:Tool': module"):
        load_tools(["team_tools_x:Tool"], limits=ToolLimits())
    with pytest.raises(CodeNotAllowedError, match=r"^rollout.multi_turn.interaction: interaction 'team_tools_x"):
        load_interaction("team_tools_x.Tool")
    assert not marker.exists()
    assert list(load_tools(["rlhf_ops.agent.calculator:CalculatorTool"], limits=ToolLimits())) == ["calculator"]
    monkeypatch.setenv(ALLOWED_MODULES_ENV, "team_tools_x")
    with pytest.raises(ValueError, match="gave a Tool, not a tool"):  # now imported, and checked as a tool
        load_tools(["team_tools_x:Tool"], limits=ToolLimits())
    assert marker.exists()


def test_registry_refuses_two_tools_with_one_name() -> None:
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        load_tools(["calculator", "rlhf_ops.agent.calculator:CalculatorTool"], limits=ToolLimits())


def test_interaction_builtin_and_bad_spec() -> None:
    assert load_interaction(None) is None
    assert type(load_interaction("answer_feedback")).__name__ == "AnswerFeedback"
    with pytest.raises(ValueError, match="rollout.multi_turn.interaction: .* without respond"):
        load_interaction("rlhf_ops.agent.calculator:CalculatorTool")


def _problems(*overrides: str) -> str:
    from rlhf_ops.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", ["rollout.multi_turn.enable=true", "rollout.max_new_tokens=64", *overrides])
    return str(info.value)


def test_config_multi_turn_rules_name_the_key() -> None:
    text = _problems("rollout.multi_turn.tools=[]")
    assert "rollout.multi_turn.tools: multi-turn is enabled with no tool and no interaction" in text
    text = _problems(
        "rollout.multi_turn.tools=[calculator,'bad spec!']", "rollout.multi_turn.max_tool_response_tokens=64"
    )
    assert "rollout.multi_turn.tools: 'bad spec!' is neither a built-in" in text
    assert "rollout.multi_turn.max_tool_response_tokens: 64 is not below rollout.max_new_tokens=64" in text
    assert "data.apply_chat_template: tools are described" in text


def test_config_multi_turn_valid() -> None:
    cfg = load_config(
        "tiny-cpu",
        [
            "rollout.multi_turn.enable=true",
            "rollout.max_new_tokens=64",
            "rollout.multi_turn.max_tool_response_tokens=16",
            "rollout.multi_turn.interaction=answer_feedback",
        ],
    )
    assert cfg.rollout.multi_turn.max_turns == 4 and cfg.rollout.multi_turn.tools == []


def test_preflight_builds_the_tools_and_names_the_key() -> None:
    from rlhf_ops.config.multi_turn import MultiTurnConfig
    from rlhf_ops.pipeline.preflight_checks import check_multi_turn

    ok = MultiTurnConfig(enable=True, tools=["calculator", "python", "tests.support.tools:Counter"])
    assert check_multi_turn(ok) == []  # 'python' is built by the workers, not here
    bad = MultiTurnConfig(
        enable=True, tools=["tests.support.tools:Nope"], interaction="rlhf_ops.agent.calculator:CalculatorTool"
    )
    problems = check_multi_turn(bad)
    assert [p.key for p in problems] == ["rollout.multi_turn.tools", "rollout.multi_turn.interaction"]
    assert "has no attribute 'Nope'" in problems[0].message
    assert "without respond" in problems[1].message


def test_example_tool_prompt_needs_a_tool_with_an_example() -> None:
    from rlhf_ops.config.multi_turn import MultiTurnConfig
    from rlhf_ops.pipeline.preflight_checks import check_multi_turn

    assert load_config("tiny-cpu").rollout.multi_turn.tool_prompt == "schemas"  # the default: prompts unchanged
    ok = MultiTurnConfig(enable=True, tools=["calculator", "tests.support.tools:Counter"], tool_prompt="example")
    assert check_multi_turn(ok) == []
    bad = MultiTurnConfig(enable=True, tools=["python", "tests.support.tools:Counter"], tool_prompt="example")
    [problem] = check_multi_turn(bad)
    assert problem.key == "rollout.multi_turn.tool_prompt"
    assert "none of ['python', 'tests.support.tools:Counter'] has one" in problem.message
    assert "tool_prompt=schemas" in problem.fix
    text = _problems("rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.tool_prompt=fewshot")
    assert "rollout.multi_turn.tool_prompt" in text and "example" in text
