"""The agent loop: multi-turn rollouts with tools and interactions, on any generation engine.

Notation: B = samples (rows), R = ``response_length`` (the whole multi-turn response's token budget).

One sample's response is the concatenation of its turns: the model's tokens (``response_mask`` 1), then
an observation (tool results or an environment reply, rendered by the chat template; mask 0, attended),
then the model again, until the model stops without a tool call, ``max_turns`` model turns ran, or the
budget R is used up. ``rollout_log_probs`` are the engine's on model tokens and 0 on observations.

The loop is engine-agnostic: it calls ``generate(contexts, max_new_tokens) -> completions`` (one
completion per context: the new token ids, ending at an EOS or the budget, and their log-probs), so the
HF engine, vLLM, a remote server or a scripted test model plug in the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlhf_ops.agent.chat_format import ObservationRenderer, parse_tool_calls
from rlhf_ops.agent.interaction import Interaction
from rlhf_ops.agent.tools import SampleState, Tool, ToolLimits, run_tool


@dataclasses.dataclass(frozen=True)
class Completion:
    """What the engine generated for one context: token ids (at most the budget) and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]


GenerateFn = Callable[[list[list[int]], list[int]], list[Completion]]
"""``generate(contexts, max_new_tokens)``: one :class:`Completion` per context, each stopping at an EOS or
at its own budget. An engine that must run collectively (FSDP) is also called with empty lists."""


@dataclasses.dataclass
class AgentSample:
    """One finished sample: its response (model and observation tokens) and its state."""

    response_ids: list[int]
    response_mask: list[int]
    """1 on model tokens, 0 on observation tokens; same length as ``response_ids``."""
    logprobs: list[float]
    state: SampleState


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentLoopConfig:
    """Flat settings of :class:`AgentLoop` (from ``rollout.multi_turn`` and ``rollout.max_new_tokens``)."""

    max_turns: int = 4
    """Most model turns per sample; tool calls in the last one are not run."""
    response_length: int = 256
    """R: the whole response's budget (model + observation tokens)."""
    max_tool_response_tokens: int = 256
    """An observation message longer than this many tokens is cut and marked (an error the model sees)."""
    limits: ToolLimits = ToolLimits()


class AgentLoop:
    """Runs multi-turn episodes for a batch of prompts.

    Args:
        tokenizer: The policy's HF tokenizer (decodes turns, renders observations).
        tools: Tools by name (empty: no tool calls are parsed).
        config: Turn, budget and tool limits.
        eos_token_ids: Ids that end a model turn.
        interaction: Answers turns without tool calls; None ends the episode there.
        any_active: Called once per round with "this process still has running samples"; returns whether
            any process has (an all-reduce under FSDP, where every rank must generate the same rounds).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Mapping[str, Tool],
        config: AgentLoopConfig,
        eos_token_ids: Sequence[int],
        interaction: Interaction | None = None,
        any_active: Callable[[bool], bool] = bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = dict(tools)
        self.config = config
        self.eos = frozenset(int(i) for i in eos_token_ids)
        self.interaction = interaction
        self.any_active = any_active
        self.renderer = ObservationRenderer(tokenizer)

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        generate: GenerateFn,
        *,
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[AgentSample]:
        """Runs every prompt (B token-id lists, no padding) to the end of its episode.

        Args:
            prompts: B prompts as token ids.
            generate: The engine (see :data:`GenerateFn`).
            rows: B dicts of the rows' columns (``ground_truth``...) for tools and interactions.
        """
        budget = self.config.response_length
        samples = [
            AgentSample([], [], [], SampleState(index=i, row=(rows[i] if rows is not None else {})))
            for i in range(len(prompts))
        ]
        active = list(range(len(prompts)))
        while self.any_active(bool(active)):
            contexts = [list(prompts[i]) + samples[i].response_ids for i in active]
            budgets = [budget - len(samples[i].response_ids) for i in active]
            completions = generate(contexts, budgets)
            if len(completions) != len(active):
                raise RuntimeError(f"generate returned {len(completions)} completions for {len(active)} contexts")
            finished = [self._turn(samples[i], c) for i, c in zip(active, completions, strict=True)]
            active = [i for i, done in zip(active, finished, strict=True) if not done]
        return samples

    # ------------------------------------------------------------------------------------------- internals
    def _turn(self, sample: AgentSample, completion: Completion) -> bool:
        """Appends one model turn and its observation; True when the sample is finished."""
        state, budget = sample.state, self.config.response_length
        tokens = completion.token_ids[: budget - len(sample.response_ids)]
        logprobs = list(completion.logprobs[: len(tokens)]) + [0.0] * (len(tokens) - len(completion.logprobs))
        sample.response_ids += tokens
        sample.response_mask += [1] * len(tokens)
        sample.logprobs += logprobs
        state.turns += 1
        if not tokens or tokens[-1] not in self.eos:  # cut by the budget mid-turn
            state.truncated = True
            return True
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if state.turns >= self.config.max_turns:  # the last turn's tool calls are counted, never run
            state.tool_calls += len(parse_tool_calls(text)) if self.tools else 0
            return True
        messages = self._observation(text, state)
        if messages is None:
            return True
        observation = self.renderer.render(messages, last_token_text=self.tokenizer.decode(tokens[-1:]))
        room = budget - len(sample.response_ids)
        observation = observation[:room]
        sample.response_ids += observation
        sample.response_mask += [0] * len(observation)
        sample.logprobs += [0.0] * len(observation)
        state.observation_turns += 1
        if len(observation) >= room:  # no token left for the model
            state.truncated = True
            return True
        return False

    def _observation(self, text: str, state: SampleState) -> list[dict[str, Any]] | None:
        """The messages answering a model turn (tool results or an environment reply), or None: the end."""
        calls = parse_tool_calls(text) if self.tools else []
        if calls:
            results = []
            for call in calls:
                state.tool_calls += 1
                if call.error is not None:
                    state.tool_errors += 1
                    results.append(f"Error: {call.error}.")
                else:
                    results.append(run_tool(self.tools, call.name, call.arguments, state, self.config.limits))
            return self.renderer.tool_messages([self._cap(r, state) for r in results])
        if self.interaction is None:
            return None
        reply = self.interaction.respond(text, state)
        if reply is None:
            return None
        state.interaction_turns += 1
        return [{"role": "user", "content": self._cap(reply, state)}]

    def _cap(self, text: str, state: SampleState) -> str:
        """``text`` cut to ``max_tool_response_tokens`` tokens, with a note the model reads."""
        limit = self.config.max_tool_response_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return text
        state.tool_errors += "[output cut at" not in text  # not twice for one output (run_tool's character cut)
        note = f"\n[Error: output cut at {limit} tokens]"
        keep = max(limit - len(self.tokenizer(note, add_special_tokens=False)["input_ids"]), 0)
        return self.tokenizer.decode(ids[:keep]) + note  # the note counts against the limit, so the cap holds
