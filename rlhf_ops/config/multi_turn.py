"""``rollout.multi_turn``: multi-turn, tool-using rollouts (the agent loop, :mod:`rlhf_ops.agent`).

Its own module so the schema stays readable; :class:`~rlhf_ops.config.schema.RolloutConfig` holds it.
Cross-field rules (the budget against ``rollout.max_new_tokens``, engines, spec syntax) are in
:func:`multi_turn_problems`, called by :mod:`rlhf_ops.config.validate`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_ops.code_policy import split_dotted
from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.section import Section

BUILTIN_TOOL_NAMES = ("calculator", "python")
BUILTIN_INTERACTION_NAMES = ("answer_feedback",)


class MultiTurnConfig(Section):
    """The agent loop: turns, tools, limits. Off by default (single-turn rollouts)."""

    enable: bool = Field(False, description="Run rollouts through the agent loop (tools / interaction turns).")
    max_turns: int = Field(4, gt=0, description="Most model turns per sample (tool calls of the last are not run).")
    tools: list[str] = Field(
        default_factory=list,
        description="Tools: built-ins 'calculator', 'python' (sandboxed) or dotted paths 'pkg.module:MyTool'.",
    )
    interaction: str | None = Field(
        None, description="Environment answering turns without tool calls: 'answer_feedback' or 'pkg.module:Cls'."
    )
    max_tool_response_tokens: int = Field(
        256, gt=0, description="An observation longer than this is cut (the model sees an error note)."
    )
    tool_timeout_s: float = Field(5.0, gt=0.0, description="Wall-clock limit of one tool call (seconds).")
    max_tool_output_chars: int = Field(4000, gt=0, description="Characters of tool output kept before tokenising.")
    tool_prompt: Literal["schemas", "example"] = Field(
        "schemas",
        description="How prompts show the tools: 'schemas' (their JSON schemas and the call format) or 'example' "
        "(the same, then one worked call per tool that has one, as chat turns before the question; calculator has).",
    )


def _spec_problem(key: str, spec: str, builtins: tuple[str, ...]) -> ConfigProblem | None:
    if spec in builtins:
        return None
    module, attr = split_dotted(spec)
    names = [*module.split("."), *attr.split(".")]
    if module and attr and all(n.isidentifier() for n in names):
        return None
    return ConfigProblem(
        key, f"{spec!r} is neither a built-in {list(builtins)} nor a dotted path", "use e.g. 'my_pkg.tools:MyTool'"
    )


def multi_turn_problems(
    cfg: MultiTurnConfig, *, max_new_tokens: int, apply_chat_template: bool, tensor_parallel_size: int
) -> list[ConfigProblem]:
    """Cross-field problems of ``rollout.multi_turn`` (empty when it is off or consistent).

    Takes the few other values it checks against (not the whole run config: the schema imports this module).
    """
    if not cfg.enable:
        return []
    problems = [p for s in cfg.tools if (p := _spec_problem("rollout.multi_turn.tools", s, BUILTIN_TOOL_NAMES))]
    if cfg.interaction is not None and (
        p := _spec_problem("rollout.multi_turn.interaction", cfg.interaction, BUILTIN_INTERACTION_NAMES)
    ):
        problems.append(p)
    if not cfg.tools and cfg.interaction is None:
        problems.append(
            ConfigProblem(
                "rollout.multi_turn.tools",
                "multi-turn is enabled with no tool and no interaction, so every episode has one turn",
                "list tools (e.g. ['calculator']) or set rollout.multi_turn.interaction, or set enable=false",
            )
        )
    if len(set(cfg.tools)) != len(cfg.tools):
        problems.append(ConfigProblem("rollout.multi_turn.tools", f"{cfg.tools} lists a tool twice", "list once"))
    if cfg.max_tool_response_tokens >= max_new_tokens:
        problems.append(
            ConfigProblem(
                "rollout.multi_turn.max_tool_response_tokens",
                f"{cfg.max_tool_response_tokens} is not below rollout.max_new_tokens={max_new_tokens}, "
                "the budget of the whole multi-turn response (model and tool tokens)",
                "lower it or raise rollout.max_new_tokens",
            )
        )
    if cfg.tools and not apply_chat_template:
        problems.append(
            ConfigProblem(
                "data.apply_chat_template",
                "tools are described to the model in the prompt through the chat template",
                "set data.apply_chat_template=true (and give prompts as chat messages)",
            )
        )
    if tensor_parallel_size > 1:
        problems.append(
            ConfigProblem(
                "rollout.tensor_model_parallel_size",
                f"{tensor_parallel_size}: the agent loop runs one engine per rank",
                "set 1 with rollout.multi_turn.enable=true",
            )
        )
    return problems
