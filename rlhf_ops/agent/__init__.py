"""Multi-turn, tool-using rollouts: the agent loop, the tool contract and registry, built-in tools.

Torch-free: the loop drives any engine through a ``generate(contexts, max_new_tokens)`` callable (in rounds) or
an ``async generate(index, context, max_new_tokens)`` one (a coroutine per sample); the
worker layer (``workers/rollout/multi_turn.py``) adapts the HF and vLLM engines and adds the sandboxed
Python tool (``workers/tools/python_sandbox.py``). User guide: ``docs/multi_turn.md``.
"""

from rlhf_ops.agent.calculator import CalculatorTool, evaluate
from rlhf_ops.agent.chat_format import ObservationRenderer, encode_chat_prompt, parse_tool_calls
from rlhf_ops.agent.interaction import AnswerFeedback, Interaction
from rlhf_ops.agent.loop import AgentLoop, AgentLoopConfig, AgentSample, AsyncGenerateFn, Completion, GenerateFn
from rlhf_ops.agent.metrics import ROW_KEYS, multi_turn_metrics, row_counters
from rlhf_ops.agent.registry import BUILTIN_TOOLS, load_interaction, load_tools
from rlhf_ops.agent.tools import SampleState, Tool, ToolError, ToolLimits, function_schema, run_tool

__all__ = [
    "BUILTIN_TOOLS",
    "ROW_KEYS",
    "AgentLoop",
    "AgentLoopConfig",
    "AgentSample",
    "AnswerFeedback",
    "AsyncGenerateFn",
    "CalculatorTool",
    "Completion",
    "GenerateFn",
    "Interaction",
    "ObservationRenderer",
    "SampleState",
    "Tool",
    "ToolError",
    "ToolLimits",
    "encode_chat_prompt",
    "evaluate",
    "function_schema",
    "load_interaction",
    "load_tools",
    "multi_turn_metrics",
    "parse_tool_calls",
    "row_counters",
    "run_tool",
]
