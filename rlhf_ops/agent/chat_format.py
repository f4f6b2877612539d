"""How tool calls and observations are written: OpenAI-style function calling through the chat template.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
Hermes / Qwen2.5 convention) anywhere in its turn, one block per call. Observations are rendered by the
model's own chat template:

- a template that renders ``tools=`` (Qwen2.5, Llama 3.1...) gets the schemas through ``tools=`` and the
  results as ``{"role": "tool"}`` messages;
- a template that ignores ``tools=`` (SmolLM2's plain ChatML) gets :func:`tools_system_prompt` as a
  system message and each result as a ``user`` message ``<tool_response>...</tool_response>``, which is
  how Qwen2.5's template itself renders tool messages.

The token ids of an observation are the template's text *between* the model's last token and the next
assistant header (:class:`ObservationRenderer`): the closing text the model did not generate (ChatML's
``\\n`` after ``<|im_end|>``), the new messages, and the generation prompt.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from rlhf_ops.agent.tools import ToolExample

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One ``<tool_call>`` block: a name and arguments, or the reason it could not be read."""

    name: str
    arguments: Any
    error: str | None = None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>`` block of a model turn, in order; malformed ones carry an ``error``.

    An opening tag without a closing one (the turn was cut) counts as one malformed call.
    """
    calls: list[ParsedCall] = []
    for body in TOOL_CALL.findall(text):
        try:
            payload = json.loads(body.strip())
        except json.JSONDecodeError as err:
            calls.append(ParsedCall("", None, f"the tool call is not valid JSON ({err.msg} at {err.pos})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ParsedCall("", None, 'a tool call must be {"name": "<tool>", "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments as a JSON string (OpenAI's wire format)
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                calls.append(ParsedCall(payload["name"], None, "the arguments string is not valid JSON"))
                continue
        calls.append(ParsedCall(payload["name"], arguments))
    if text.count(OPEN_TAG) > len(TOOL_CALL.findall(text)):
        calls.append(ParsedCall("", None, "a <tool_call> block is not closed with </tool_call>"))
    return calls


def tools_system_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """The system message that describes the tools to a template that ignores ``tools=``."""
    listing = "\n".join(json.dumps(s, sort_keys=True) for s in schemas)
    return (
        "You may call tools to help you. The tools are:\n<tools>\n"
        f"{listing}\n</tools>\n"
        "To call a tool, write one block per call:\n"
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
        "The result comes back in <tool_response></tool_response>. Then continue and give the final answer."
    )


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows ``tools=`` to the model (False for SmolLM2's ChatML)."""
    messages = [{"role": "user", "content": "hi"}]
    probe = [{"type": "function", "function": {"name": "probe_tool_x", "description": "d", "parameters": {}}}]
    try:
        return "probe_tool_x" in _render(tokenizer, messages, tools=probe, add_generation_prompt=True)
    except Exception:  # a template that fails on tools= does not support them
        return False


def with_tools(messages: Sequence[dict[str, Any]], schemas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool description merged into (or put before them as) the system message."""
    out = [dict(m) for m in messages]
    prompt = tools_system_prompt(schemas)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_result_message(text: str, *, native_tools: bool) -> dict[str, Any]:
    """One tool result as a message: ``{"role": "tool"}`` for a template that renders tools, else a ``user``
    message ``<tool_response>...</tool_response>`` (how Qwen2.5's template renders tool messages)."""
    if native_tools:
        return {"role": "tool", "content": text}
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def example_messages(example: ToolExample, *, native_tools: bool) -> list[dict[str, Any]]:
    """A worked call as chat turns: the question, the model's ``<tool_call>``, the result, the model's answer."""
    call = json.dumps({"name": example.name, "arguments": example.arguments})
    return [
        {"role": "user", "content": example.question},
        {"role": "assistant", "content": f"{OPEN_TAG}{call}</tool_call>"},
        tool_result_message(example.result, native_tools=native_tools),
        {"role": "assistant", "content": example.answer},
    ]


def _after_system(messages: list[dict[str, Any]], inserted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with ``inserted`` after the leading system message (or first, when there is none)."""
    cut = 1 if messages and messages[0].get("role") == "system" else 0
    return [*messages[:cut], *inserted, *messages[cut:]]


def encode_chat_prompt(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    schemas: Sequence[dict[str, Any]],
    examples: Sequence[ToolExample] = (),
) -> list[int]:
    """Prompt ids of chat ``messages`` with the tools described (``tools=`` or the system-message convention),
    preceded by the worked ``examples`` as chat turns (``rollout.multi_turn.tool_prompt=example``)."""
    native = template_renders_tools(tokenizer)
    shots = [m for example in examples for m in example_messages(example, native_tools=native)]
    if native:
        chat = _after_system(list(messages), shots)
        text = _render(tokenizer, chat, tools=list(schemas), add_generation_prompt=True)
    else:
        text = _render(tokenizer, _after_system(with_tools(messages, schemas), shots), add_generation_prompt=True)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


class ObservationRenderer:
    """Token ids of tool results or environment replies that follow a model turn, via the chat template.

    Args:
        tokenizer: A HF tokenizer with a chat template (a template-less one uses plain ChatML-like text).
    """

    _BASE = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "ASSISTANT_END_MARK"},
    ]

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.native_tools = template_renders_tools(tokenizer) if getattr(tokenizer, "chat_template", None) else False
        if getattr(tokenizer, "chat_template", None):
            base = _render(tokenizer, self._BASE)
            self._base = base
            self._assistant_close = base[base.rindex("ASSISTANT_END_MARK") + len("ASSISTANT_END_MARK") :]
        else:
            self._base = ""
            self._assistant_close = "\n"

    def tool_messages(self, results: Sequence[str]) -> list[dict[str, Any]]:
        """One message per tool result, in the form the template understands."""
        return [tool_result_message(r, native_tools=self.native_tools) for r in results]

    def render(self, messages: Sequence[dict[str, Any]], *, last_token_text: str) -> list[int]:
        """Ids from just after the model's last token to the next assistant header, inclusive.

        Args:
            messages: The new messages (tool results, an environment reply).
            last_token_text: The decoded last token of the model's turn (its EOS, e.g. ``<|im_end|>``): the
                template's assistant closing text starts with it, the rest (ChatML's newline) is added here.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            body = "".join(f"\n{m['role']}: {m['content']}" for m in messages)
            text = f"{body}\nassistant: "
        else:
            full = _render(self.tokenizer, [*self._BASE, *messages], add_generation_prompt=True)
            assert full.startswith(self._base), "the chat template re-renders earlier turns differently"
            close = self._assistant_close
            glue = close[len(last_token_text) :] if last_token_text and close.startswith(last_token_text) else close
            text = glue + full[len(self._base) :]
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
