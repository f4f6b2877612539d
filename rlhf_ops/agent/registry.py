"""How tools and interactions are named in config: a built-in name or a dotted path to user code.

``rollout.multi_turn.tools`` lists specs: ``"calculator"`` (a key of :data:`BUILTIN_TOOLS`), ``"python"``
(the sandboxed executor, supplied by the worker layer as an extra built-in), or ``"my_pkg.tools:MyTool"`` /
``"my_pkg.tools.MyTool"``. A spec resolves to a :class:`~rlhf_ops.agent.tools.Tool` instance, or to a class
or factory called with no arguments (or with ``limits=`` when it accepts it) that returns one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhf_ops.agent.calculator import CalculatorTool
from rlhf_ops.agent.interaction import AnswerFeedback, Interaction
from rlhf_ops.agent.tools import Tool, ToolLimits

BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"calculator": CalculatorTool}
BUILTIN_INTERACTIONS: dict[str, Callable[..., Interaction]] = {"answer_feedback": AnswerFeedback}
WORKER_BUILTIN_TOOLS = ("python",)
"""Built-in names the worker layer supplies (``workers.tools``): valid in config, resolved there."""


def resolve_dotted(spec: str, *, what: str, key: str) -> Any:
    """The object a ``"pkg.module:attr"`` or ``"pkg.module.attr"`` spec names.

    Raises:
        ValueError: naming ``key`` and the fix, when the module or the attribute is missing.
    """
    module_name, _, attr_path = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"{key}: {what} {spec!r} is neither a built-in nor a dotted path; use 'package.module:Name'.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{key}: {what} {spec!r}: cannot import {module_name!r} ({err}); put the package on every worker's "
            "PYTHONPATH or fix the spelling ('package.module:Name')."
        ) from err
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {what} {spec!r}: {module_name!r} has no attribute {attr_path!r}; fix the name.")
        obj = getattr(obj, part)
    return obj


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
    builtins = {**BUILTIN_TOOLS, **(extra_builtins or {})}
    tools: dict[str, Tool] = {}
    for spec in specs:
        obj = builtins[spec] if spec in builtins else resolve_dotted(spec, what="tool", key="rollout.multi_turn.tools")
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
    obj = builtin if builtin is not None else resolve_dotted(spec, what="interaction", key=key)
    interaction = obj() if inspect.isclass(obj) else obj
    if not isinstance(interaction, Interaction):
        raise ValueError(f"{key}: {spec!r} gave a {type(interaction).__name__} without respond(model_text, state).")
    return interaction
