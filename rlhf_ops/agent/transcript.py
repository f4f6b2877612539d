"""Token ids and loss mask of a whole conversation, laid out exactly as the agent loop lays out a rollout.

SFT on tool-call transcripts must show the model the token sequence it will produce and read in multi-turn RL
(:mod:`rlhf_ops.agent.loop`), so a conversation is encoded with the rollout's own pieces, not by rendering
the chat template over the whole conversation:

- the prompt (messages before the first assistant turn) with :func:`~rlhf_ops.agent.chat_format.encode_chat_prompt`
  (the tools' system message and, with ``tool_prompt=example``, the worked calls), as a rollout prompt;
- each assistant turn as the model writes it: its text's tokens, then the EOS token that ends a turn;
- what follows an assistant turn (``tool`` messages, or a ``user`` message: an interaction's reply) with
  :class:`~rlhf_ops.agent.chat_format.ObservationRenderer`, as the loop's observation tokens.

The loss mask is 1 on the assistant turns' tokens (their EOS included) and 0 on the prompt and observations,
the same split as the rollout's ``response_mask``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_ops.agent.chat_format import ObservationRenderer, encode_chat_prompt
from rlhf_ops.agent.tools import ToolExample

ROLES = ("system", "user", "assistant", "tool")


def conversation_problem(messages: Any) -> str | None:
    """Why ``messages`` is not a trainable conversation (None when it is).

    It must be a list of ``{"role", "content"}`` with string content and a known role, hold at least one
    assistant turn, and start with a non-assistant message (the prompt); ``tool`` messages follow an assistant
    turn (they answer its calls).
    """
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {'role', 'content'}"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            return f"message {i} must be a mapping with a role in {list(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {i} ({message['role']}) must have string 'content'"
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        return "there is no assistant turn to learn"
    if roles[0] in ("assistant", "tool"):
        return f"the first message has role {roles[0]!r}; a conversation starts with its prompt (system / user)"
    first = roles.index("assistant")
    if "tool" in roles[:first]:
        return "a tool message comes before the first assistant turn"
    return None


def encode_conversation(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    eos_token_id: int,
    schemas: Sequence[dict[str, Any]] = (),
    examples: Sequence[ToolExample] = (),
    renderer: ObservationRenderer | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation, both of length T, in the agent loop's layout.

    Args:
        tokenizer: The policy's tokenizer (with a chat template).
        messages: A conversation accepted by :func:`conversation_problem`.
        eos_token_id: The token that ends a model turn (SmolLM2: ``<|im_end|>``); appended to each assistant turn.
        schemas: Function schemas of the tools described in the prompt (``[]``: a plain chat prompt).
        examples: Worked calls shown before the question (``tool_prompt=example``).
        renderer: An :class:`ObservationRenderer` for ``tokenizer`` (built when None; pass one to reuse it).

    Raises:
        ValueError: if ``messages`` is not a trainable conversation (:func:`conversation_problem`).
    """
    problem = conversation_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    renderer = renderer or ObservationRenderer(tokenizer)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:first]]
    if schemas:
        ids = encode_chat_prompt(tokenizer, prompt, schemas, examples)
    else:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    mask = [0] * len(ids)
    eos_text = tokenizer.decode([eos_token_id])
    pending: list[Mapping[str, Any]] = []  # messages after an assistant turn, rendered as one observation
    for message in messages[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            observation = _observation(renderer, pending, eos_text)
            ids += observation
            mask += [0] * len(observation)
            pending = []
        turn = [*tokenizer(message["content"], add_special_tokens=False)["input_ids"], eos_token_id]
        ids += [int(i) for i in turn]
        mask += [1] * len(turn)
    return ids, mask  # trailing non-assistant messages have nothing to learn: dropped


def _observation(renderer: ObservationRenderer, messages: list[Mapping[str, Any]], eos_text: str) -> list[int]:
    """Observation ids for the ``tool`` results and ``user`` replies after a model turn (the loop's rendering)."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            rendered += renderer.tool_messages([message["content"]])
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    return renderer.render(rendered, last_token_text=eos_text)
