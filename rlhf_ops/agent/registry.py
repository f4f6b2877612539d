"""How tools and interactions are named in config: a built-in name or a dotted path to user code.

``rollout.multi_turn.tools`` lists specs: ``"calculator"`` (a key of :data:`BUILTIN_TOOLS`), ``"python"``
(the sandboxed executor, supplied by the worker layer as an extra built-in), or ``"my_pkg.tools:MyTool"`` /
``"my_pkg.tools.MyTool"``. A spec resolves to a :class:`~rlhf_ops.agent.tools.Tool` instance, or to a class
or factory called with no arguments (or with ``limits=`` when it accepts it) that returns one. A dotted path
is imported only when its module is on the operator's allow-list, like a reward function's
(:func:`rlhf_ops.code_policy.import_dotted`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhf_ops.agent.calculator import CalculatorTool
from rlhf_ops.agent.interaction import AnswerFeedback, Interaction
from rlhf_ops.agent.tools import Tool, ToolLimits
from rlhf_ops.code_policy import import_dotted

BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"calculator": CalculatorTool}
BUILTIN_INTERACTIONS: dict[str, Callable[..., Interaction]] = {"answer_feedback": AnswerFeedback}
WORKER_BUILTIN_TOOLS = ("python",)
"""Built-in names the worker layer supplies (``workers.tools``): valid in config, resolved there."""
_EXAMPLE = "package.module:Name"


def _instantiate(obj: Any, limits: ToolLimits) -> Any:
    if not (inspect.isclass(obj) or (callable(obj) and not hasattr(obj, "schema"))):
        return obj  # already an instance
    try:
        accepts_limits = "limits" in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        accepts_limits = False
    try:
        return obj(limits=limits) if accepts_limits else obj()
    except TypeError as err:
        raise ValueError(
            f"rollout.multi_turn.tools: {getattr(obj, '__qualname__', obj)!r} cannot be built with no arguments "
            f"({err}); point the spec at a Tool class, a factory or an instance."
        ) from err


def load_tools(
    specs: Sequence[str], *, limits: ToolLimits, extra_builtins: Mapping[str, Callable[..., Tool]] | None = None
) -> dict[str, Tool]:
    """Tools by name for ``specs`` (``rollout.multi_turn.tools``).

    Raises:
        ValueError: on an unresolvable spec, an object that is not a tool, or two tools with one name.
    """
    key, builtins = "rollout.multi_turn.tools", {**BUILTIN_TOOLS, **(extra_builtins or {})}
    tools: dict[str, Tool] = {}
    for spec in specs:
        obj = builtins[spec] if spec in builtins else import_dotted(spec, what=f"{key}: tool", example=_EXAMPLE)
        tool = _instantiate(obj, limits)
        if not isinstance(tool, Tool):
            raise ValueError(
                f"rollout.multi_turn.tools: {spec!r} gave a {type(tool).__name__}, not a tool; it needs a 'name', "
                "schema() and call(arguments, state) (see rlhf_ops.agent.tools.Tool)."
            )
        if tool.name in tools:
            raise ValueError(f"rollout.multi_turn.tools: two tools are named {tool.name!r}; list each tool once.")
        tools[tool.name] = tool
    return tools


def load_interaction(spec: str | None) -> Interaction | None:
    """The interaction of ``rollout.multi_turn.interaction`` (None: none).

    Raises:
        ValueError: on an unresolvable spec or an object without ``respond``.
    """
    if spec is None:
        return None
    key = "rollout.multi_turn.interaction"
    builtin = BUILTIN_INTERACTIONS.get(spec)
    obj = builtin if builtin is not None else import_dotted(spec, what=f"{key}: interaction", example=_EXAMPLE)
    interaction = obj() if inspect.isclass(obj) else obj
    if not isinstance(interaction, Interaction):
        raise ValueError(f"{key}: {spec!r} gave a {type(interaction).__name__} without respond(model_text, state).")
    return interaction
