"""The built-in ``calculator`` tool: arithmetic through a whitelist AST evaluator (never ``eval``).

Accepted: numbers, ``+ - * / // % **``, unary ``+``/``-``, parentheses and the functions ``abs``,
``round``, ``min``, ``max``, ``sqrt``. Exponents and results are bounded, so ``9**9**9`` is an error
observation instead of a hung rollout.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from rlhf_ops.agent.tools import SampleState, ToolError, ToolExample, function_schema

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100
MAX_EXPRESSION_CHARS = 500
EXAMPLE_EXPRESSION = "3 * 4"


def _check(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ToolError(f"unsupported value {value!r}")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"result exceeds {MAX_MAGNITUDE:g}")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError, ValueError) as err:
            raise ToolError(str(err)) from err
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise ToolError("keyword arguments are not supported")
        try:
            return _check(_FUNCTIONS[node.func.id](*[_eval(a) for a in node.args]))
        except (TypeError, ValueError) as err:
            raise ToolError(f"{node.func.id}: {err}") from err
    raise ToolError(f"unsupported expression element {type(node).__name__}; use numbers, + - * / // % ** and ( )")


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic ``expression``.

    Raises:
        ToolError: on syntax errors, names, attributes, calls outside the whitelist, or bounds.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from err
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class CalculatorTool:
    """Evaluates one arithmetic expression: ``{"expression": "(17 + 5) * 3"}`` -> ``"66"``."""

    name = "calculator"

    def schema(self) -> dict[str, Any]:
        """The function schema shown to the model."""
        return function_schema(
            self.name,
            "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the number.",
            {"expression": {"type": "string", "description": "e.g. '(17 + 5) * 3'"}},
            ["expression"],
        )

    def example(self) -> ToolExample:
        """One worked call (``rollout.multi_turn.tool_prompt=example``); its result is this tool's own output."""
        arguments = {"expression": EXAMPLE_EXPRESSION}
        result = self.call(arguments, SampleState(index=0))
        return ToolExample(
            name=self.name,
            question="Kim has 3 bags with 4 pens in each bag. How many pens does Kim have?",
            arguments=arguments,
            result=result,
            answer=f"Kim has {EXAMPLE_EXPRESSION} = {result} pens.",
        )

    def call(self, arguments: dict[str, Any], state: SampleState) -> str:
        """Returns the value as text; raises :class:`ToolError` for a missing or bad expression."""
        del state
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError("calculator needs a string argument 'expression'")
        value = evaluate(expression)
        return str(round(value, 10) if isinstance(value, float) else value)
