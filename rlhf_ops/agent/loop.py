"""The agent loop: multi-turn rollouts with tools and interactions, on any generation engine.

Notation: B = samples (rows), R = ``response_length`` (the whole multi-turn response's token budget).

One sample's response is the concatenation of its turns: the model's tokens (``response_mask`` 1), then
an observation (tool results or an environment reply, rendered by the chat template; mask 0, attended),
then the model again, until the model stops without a tool call, ``max_turns`` model turns ran, or the
budget R is used up. ``rollout_log_probs`` are the engine's on model tokens and 0 on observations.

The loop is engine-agnostic, and runs in one of two schedules over the same per-sample state machine
(:meth:`AgentLoop._model_turn` -> :meth:`AgentLoop._answer` -> :meth:`AgentLoop._observe`), so both give the
same tokens, masks and counters for the same model outputs:

- :meth:`AgentLoop.run`, in **rounds**: ``generate(contexts, max_new_tokens) -> completions`` (one completion
  per running sample: the new token ids, ending at an EOS or the budget, and their log-probs), then every
  sample's tools, then the next round. A round waits for its slowest sample; collective engines (the HF engine
  under FSDP, the in-process ``vllm.LLM``) need it.
- :meth:`AgentLoop.arun`, **one coroutine per sample** on an async engine: ``await generate(index, context,
  max_new_tokens)`` for one sample's turn, its tools (or interaction) on a thread of a pool, so the event loop
  keeps serving the other samples, then its next turn at once. A sample whose tool returns early generates its
  next turn while the others still generate or wait on theirs (continuous batching across samples and turns).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlhf_ops.agent.chat_format import ObservationRenderer, ParsedCall, parse_tool_calls
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

AsyncGenerateFn = Callable[[int, list[int], int], Awaitable[Completion]]
"""``await generate(sample_index, context, max_new_tokens)``: one sample's next turn (:meth:`AgentLoop.arun`),
stopping at an EOS or at the budget. Called concurrently for different samples, never twice at once for one."""

MAX_TOOL_THREADS = 64
"""Most tool calls :meth:`AgentLoop.arun` runs at once (threads of its pool); more wait for a free thread."""


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


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A finished model turn waiting for its answer: tool calls to run, or (no calls) the interaction's reply."""

    text: str
    """The turn's text, special tokens skipped (what the interaction reads)."""
    calls: list[ParsedCall]
    last_token_text: str
    """The turn's last token, decoded (the renderer glues the observation to it)."""


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
            :meth:`arun` never calls it (an async engine is not collective).

    Tools run one call at a time per sample, but :meth:`arun` runs different samples' calls at once on
    threads: a tool keeps per-sample data in ``state.data`` (the built-ins hold none).
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
        """Runs every prompt (B token-id lists, no padding) to the end of its episode, in rounds.

        Args:
            prompts: B prompts as token ids.
            generate: The engine (see :data:`GenerateFn`).
            rows: B dicts of the rows' columns (``ground_truth``...) for tools and interactions.
        """
        samples = self._new_samples(len(prompts), rows)
        active = list(range(len(prompts)))
        while self.any_active(bool(active)):
            requests = [self._request(samples[i], prompts[i]) for i in active]
            completions = generate([c for c, _ in requests], [b for _, b in requests])
            if len(completions) != len(active):
                raise RuntimeError(f"generate returned {len(completions)} completions for {len(active)} contexts")
            finished = [self._turn(samples[i], c) for i, c in zip(active, completions, strict=True)]
            active = [i for i, done in zip(active, finished, strict=True) if not done]
        return samples

    async def arun(
        self,
        prompts: Sequence[Sequence[int]],
        generate: AsyncGenerateFn,
        *,
        rows: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[AgentSample]:
        """Runs every prompt to the end of its episode, one coroutine per sample (same results as :meth:`run`).

        Each sample loops on its own: ``await generate(...)`` for its turn, its tool calls (or the interaction)
        on a thread of a pool of at most :data:`MAX_TOOL_THREADS` (tools block: a sandbox process, a remote
        environment; the event loop keeps serving the other samples meanwhile), its observation, its next turn.

        Args:
            prompts: B prompts as token ids.
            generate: The async engine (see :data:`AsyncGenerateFn`).
            rows: B dicts of the rows' columns (``ground_truth``...) for tools and interactions.
        """
        samples = self._new_samples(len(prompts), rows)
        if not samples:
            return samples
        pool = ThreadPoolExecutor(max_workers=min(len(samples), MAX_TOOL_THREADS), thread_name_prefix="agent-tool")
        tasks = [
            asyncio.ensure_future(self._episode(sample, prompt, generate, pool))
            for sample, prompt in zip(samples, prompts, strict=True)
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # one sample's error (or a cancel) stops the others; the first error is raised
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:  # never blocks the event loop: a tool still running after an error ends at its time limit
            pool.shutdown(wait=False)
        return samples

    async def _episode(
        self, sample: AgentSample, prompt: Sequence[int], generate: AsyncGenerateFn, pool: ThreadPoolExecutor
    ) -> None:
        """One sample's episode: the steps of :meth:`_turn`, with a suspension at the engine and at the tools."""
        loop = asyncio.get_running_loop()
        while True:
            context, budget = self._request(sample, prompt)
            completion = await generate(sample.state.index, context, budget)
            pending = self._model_turn(sample, completion)
            if pending is None:
                return
            answer = await loop.run_in_executor(pool, self._answer, pending, sample.state)
            if self._observe(sample, pending, answer):
                return

    # ------------------------------------------------------------------------------------------- internals
    def _new_samples(self, count: int, rows: Sequence[Mapping[str, Any]] | None) -> list[AgentSample]:
        return [
            AgentSample([], [], [], SampleState(index=i, row=(rows[i] if rows is not None else {})))
            for i in range(count)
        ]

    def _request(self, sample: AgentSample, prompt: Sequence[int]) -> tuple[list[int], int]:
        """The next turn's context (prompt + response so far) and token budget (what is left of R)."""
        return [*prompt, *sample.response_ids], self.config.response_length - len(sample.response_ids)

    def _turn(self, sample: AgentSample, completion: Completion) -> bool:
        """Appends one model turn and its observation; True when the sample is finished (:meth:`run`'s step)."""
        pending = self._model_turn(sample, completion)
        return pending is None or self._observe(sample, pending, self._answer(pending, sample.state))

    def _model_turn(self, sample: AgentSample, completion: Completion) -> _Pending | None:
        """Appends a model turn and parses its tool calls; None when the episode ends with it."""
        state, budget = sample.state, self.config.response_length
        tokens = completion.token_ids[: budget - len(sample.response_ids)]
        logprobs = list(completion.logprobs[: len(tokens)]) + [0.0] * (len(tokens) - len(completion.logprobs))
        sample.response_ids += tokens
        sample.response_mask += [1] * len(tokens)
        sample.logprobs += logprobs
        state.turns += 1
        if not tokens or tokens[-1] not in self.eos:  # cut by the budget mid-turn
            state.truncated = True
            return None
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        calls = parse_tool_calls(text) if self.tools else []
        state.tool_calls += len(calls)
        if state.turns >= self.config.max_turns:  # the last turn's tool calls are counted, never run
            return None
        if not calls and self.interaction is None:
            return None
        return _Pending(text, calls, self.tokenizer.decode(tokens[-1:]))

    def _answer(self, pending: _Pending, state: SampleState) -> list[str] | str | None:
        """The blocking part of a turn (no tokenizer; on a tool thread under :meth:`arun`): the tool results in
        call order (a malformed call's is its error), or the interaction's reply (None: the episode ends)."""
        if not pending.calls:
            assert self.interaction is not None
            return self.interaction.respond(pending.text, state)
        results = []
        for call in pending.calls:
            if call.error is not None:
                state.tool_errors += 1
                results.append(f"Error: {call.error}.")
            else:
                results.append(run_tool(self.tools, call.name, call.arguments, state, self.config.limits))
        return results

    def _observe(self, sample: AgentSample, pending: _Pending, answer: list[str] | str | None) -> bool:
        """Appends the observation answering a turn; True when the sample is finished."""
        state, budget = sample.state, self.config.response_length
        if answer is None:
            return True
        if isinstance(answer, str):
            state.interaction_turns += 1
            messages = [{"role": "user", "content": self._cap(answer, state)}]
        else:
            messages = self.renderer.tool_messages([self._cap(r, state) for r in answer])
        observation = self.renderer.render(messages, last_token_text=pending.last_token_text)
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
