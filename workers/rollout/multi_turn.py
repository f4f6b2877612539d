"""Multi-turn rollouts on the HF and vLLM engines: :class:`MultiTurnRollout` runs the agent loop.

Notation: B = rows (prompts x n), P = prompt length (left-padded), R = ``rollout.max_new_tokens`` (the
budget of the whole multi-turn response), T = P + R.

Output keys and shapes are the single-turn engines' (:mod:`workers.rollout.base`) with two differences:
``response_mask`` (B, R) is 1 on model tokens only, so it has holes where tool or environment tokens
(observations) sit inside the response; the response part of ``attention_mask`` is 1 on every token up to
the response's end, observations included. Plus one (B,) int64 counter per key of
:data:`rlhf_ops.agent.metrics.ROW_KEYS`.

Schedules (:mod:`rlhf_ops.agent.loop`): on the async engine (``AsyncVLLMRollout``, ``rollout.mode=async``) every
sample runs its own coroutine on the engine's event loop (:meth:`AgentLoop.arun`: one request per sample and turn,
the next one submitted as soon as that sample's tools returned); the HF engine and the sync ``vllm.LLM`` run in
rounds (:meth:`AgentLoop.run`). Both share the per-sample state machine, so greedy outputs are identical.

Collective engines: the HF engine under FSDP must run the same forwards on every rank, so every round
all-reduces "any sample still running", a rank without running samples decodes one finished dummy row,
and every round decodes R steps at most with the engine's own all-ranks-finished check.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Literal

import numpy as np
import torch

from rlhf_ops.agent import (
    AgentLoop,
    AgentLoopConfig,
    AsyncGenerateFn,
    Completion,
    GenerateFn,
    ToolLimits,
    load_interaction,
    load_tools,
)
from rlhf_ops.agent.metrics import row_counters
from rlhf_ops.agent.tools import Tool
from rlhf_ops.config.multi_turn import MultiTurnConfig
from rlhf_ops.padding import compute_position_ids, pad_sequences_left, pad_sequences_right
from rlhf_ops.protocol import DataProto
from workers.rollout.async_vllm_rollout import AsyncVLLMRollout
from workers.rollout.base import RolloutEngine, SamplingParams, build_rollout_output
from workers.rollout.hf_rollout import HFRollout
from workers.rollout.sampling import sample_next_tokens
from workers.tools.python_sandbox import PythonSandboxTool

WORKER_TOOLS = {"python": PythonSandboxTool}


def build_tools(cfg: MultiTurnConfig) -> dict[str, Tool]:
    """The tools of ``rollout.multi_turn.tools`` (built-ins, the sandboxed ``python``, dotted paths)."""
    limits = ToolLimits(timeout_s=cfg.tool_timeout_s, max_output_chars=cfg.max_tool_output_chars)
    return load_tools(cfg.tools, limits=limits, extra_builtins=WORKER_TOOLS)


def maybe_multi_turn(engine: RolloutEngine, cfg: MultiTurnConfig, *, tokenizer_path: str) -> RolloutEngine:
    """``engine`` itself, or wrapped in :class:`MultiTurnRollout` when ``rollout.multi_turn.enable``."""
    if not cfg.enable:
        return engine
    from rlhf_ops.data.images import load_tokenizer_or_processor

    return MultiTurnRollout(engine, cfg, tokenizer=load_tokenizer_or_processor(tokenizer_path))


class MultiTurnRollout:
    """A :class:`~workers.rollout.base.RolloutEngine` that runs the agent loop on an HF or vLLM engine.

    Args:
        engine: The single-turn engine (:class:`HFRollout` or ``VLLMRollout``); weights, sleep and wake-up
            go to it unchanged.
        cfg: ``rollout.multi_turn``.
        tokenizer: The policy's tokenizer (chat template, decoding turns).
        schedule: ``per_sample`` (a coroutine per sample; the async engine only), ``rounds``, or ``auto``:
            per sample on the async engine, rounds on the others.

    Raises:
        ValueError: ``schedule="per_sample"`` on an engine without an event loop.
    """

    def __init__(
        self,
        engine: Any,
        cfg: MultiTurnConfig,
        *,
        tokenizer: Any,
        schedule: Literal["auto", "rounds", "per_sample"] = "auto",
    ) -> None:
        is_async = isinstance(engine, AsyncVLLMRollout)
        if schedule == "per_sample" and not is_async:
            raise ValueError(
                f"schedule='per_sample' needs the async engine (rollout.mode=async), got {type(engine).__name__}; "
                "use schedule='rounds' or 'auto'."
            )
        self.per_sample = is_async if schedule == "auto" else schedule == "per_sample"
        self.engine = engine
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tools = build_tools(cfg)
        self.interaction = load_interaction(cfg.interaction)

    def __getattr__(self, name: str) -> Any:  # shutdown(), start_time_s... of the wrapped engine
        return getattr(self.engine, name)

    def update_weights(self, weights: Any) -> None:
        """Loads new weights into the wrapped engine."""
        self.engine.update_weights(weights)

    def release(self) -> None:
        """Frees the wrapped engine's memory."""
        self.engine.release()

    def resume(self) -> None:
        """Re-acquires the wrapped engine's memory."""
        self.engine.resume()

    @property
    def weights_released(self) -> bool:
        """The wrapped engine's (see :class:`~workers.rollout.base.RolloutEngine`)."""
        return bool(self.engine.weights_released)

    @property
    def defaults(self) -> SamplingParams:
        """The wrapped engine's default settings (a call without ``sampling`` uses them)."""
        defaults: SamplingParams = self.engine.defaults
        return defaults

    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """``n`` multi-turn samples per prompt with ``sampling`` (None: the wrapped engine's defaults), reseeded
        by ``step``; keys and shapes in the module docstring."""
        start = time.perf_counter()
        params = self.defaults if sampling is None else sampling
        assert prompts.batch is not None, "generate_sequences needs input_ids / attention_mask"
        input_ids, attention_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        device = input_ids.device
        self._reseed(step)
        input_ids, attention_mask = (t.repeat_interleave(params.n, dim=0).cpu() for t in (input_ids, attention_mask))
        columns = {k: np.repeat(v, params.n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        rows = [{k: columns[k][i] for k in columns} for i in range(input_ids.shape[0])]
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask, strict=True)]
        loop = AgentLoop(
            self.tokenizer,
            tools=self.tools,
            config=AgentLoopConfig(
                max_turns=self.cfg.max_turns,
                response_length=params.response_length,
                max_tool_response_tokens=self.cfg.max_tool_response_tokens,
                limits=ToolLimits(timeout_s=self.cfg.tool_timeout_s, max_output_chars=self.cfg.max_tool_output_chars),
            ),
            eos_token_ids=params.eos_ids,
            interaction=self.interaction,
            any_active=self._any_active,
        )
        if self.per_sample:  # on the engine's event loop; this thread waits
            samples = self.engine._run(
                loop.arun(contexts, async_vllm_generate(self.engine, params, len(contexts)), rows=rows)
            )
        else:
            samples = loop.run(contexts, self._generate_fn(params), rows=rows)
        length, pad = params.response_length, params.pad_token_id
        responses = pad_sequences_right([s.response_ids for s in samples], pad_value=pad, max_length=length)
        response_mask = pad_sequences_right([s.response_mask for s in samples], pad_value=0, max_length=length)
        attended = pad_sequences_right([[1] * len(s.response_ids) for s in samples], pad_value=0, max_length=length)
        logprobs = pad_sequences_right(
            [s.logprobs for s in samples], pad_value=0.0, max_length=length, dtype=torch.float32
        )
        counters = {k: torch.tensor(v, dtype=torch.long) for k, v in row_counters([s.state for s in samples]).items()}
        out = build_rollout_output(
            input_ids.to(device),
            attention_mask.to(device),
            responses=responses.to(device),
            response_mask=response_mask.to(device),
            log_probs=logprobs.to(device),
            columns=prompts.non_tensor_batch,
            n=params.n,
            response_attention_mask=attended.to(device),
            row_columns={k: v.to(device) for k, v in counters.items()},
        )
        out.meta_info["timing"] = {"generate_sequences": time.perf_counter() - start}
        return out

    # ------------------------------------------------------------------------------------------- engines
    def _reseed(self, step: int | None) -> None:
        """Same per-step seeding as the wrapped engine, so a resumed run samples what an uninterrupted one would."""
        if step is None:
            return
        seed = self.engine.seed * 1_000_003 + int(step)
        if isinstance(self.engine, HFRollout):
            device = next(self.engine.module.parameters()).device
            self.engine._generator = torch.Generator(device=device).manual_seed(seed)
        else:
            import random

            self.engine._seeds = random.Random(seed)

    def _collective(self) -> bool:
        if not isinstance(self.engine, HFRollout):
            return False
        sync = self.engine._sync_stop
        if sync is None:
            from workers.rollout.hf_rollout import _is_fsdp

            sync = _is_fsdp(self.engine.module) and torch.distributed.is_initialized()
        return bool(sync)

    def _any_active(self, local: bool) -> bool:
        if not self._collective():
            return local
        flag = torch.tensor(int(local), dtype=torch.int32, device=next(self.engine.module.parameters()).device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _generate_fn(self, params: SamplingParams) -> GenerateFn:
        if isinstance(self.engine, HFRollout):
            return lambda contexts, budgets: hf_generate(self.engine, params, contexts, budgets, self._collective())
        return lambda contexts, budgets: vllm_generate(self.engine, params, contexts, budgets)


def vllm_generate(
    engine: Any, params: SamplingParams, contexts: list[list[int]], budgets: list[int]
) -> list[Completion]:
    """One vLLM request per context, each with its own ``max_tokens`` (continuous batching does the rest)."""
    if not contexts:
        return []
    sampling = [
        engine._sampling_params(dataclasses.replace(params, n=1, response_length=b), engine._seeds.randrange(2**31))
        for b in budgets
    ]
    outputs = engine.generate_token_ids(contexts, sampling)  # sync engine: one batch; async: one request each
    return [_completion(request) for request in outputs]


def async_vllm_generate(engine: AsyncVLLMRollout, params: SamplingParams, count: int) -> AsyncGenerateFn:
    """The per-sample engine of :meth:`AgentLoop.arun` for ``count`` samples: one request per call.

    Seeds: one generator per sample, seeded in row order from the engine's (step-seeded) ``_seeds``; each turn
    draws from its sample's. So a sample's requests get the same seeds whatever order the samples reach the
    engine in (a resumed run samples what an uninterrupted one would).
    """
    seeds = [random.Random(engine._seeds.randrange(2**31)) for _ in range(count)]
    base = next(engine._request_ids)
    turns = [0] * count

    async def generate(index: int, context: list[int], budget: int) -> Completion:
        seed = seeds[index].randrange(2**31)
        sampling = engine._sampling_params(dataclasses.replace(params, n=1, response_length=budget), seed)
        request_id = f"rlhf-{base}-{index}-turn{turns[index]}"
        turns[index] += 1
        return _completion(await engine.generate_one(request_id, context, sampling))

    return generate


def _completion(request: Any) -> Completion:
    """A finished ``vllm.RequestOutput`` (n = 1) as the agent loop's :class:`Completion`."""
    done = request.outputs[0]
    tokens = list(done.token_ids)
    steps = list(done.logprobs or [])
    return Completion(tokens, [step[t].logprob for step, t in zip(steps, tokens, strict=False)])


@torch.no_grad()
def hf_generate(
    engine: HFRollout, params: SamplingParams, contexts: list[list[int]], budgets: list[int], collective: bool
) -> list[Completion]:
    """Decodes every context up to its own budget with the HF engine's module, sampler and generator.

    Collective (FSDP): R steps at most on every rank (the engine's all-ranks check ends earlier), and a rank
    without contexts decodes one dummy row that is finished from the start.
    """
    real = len(contexts)
    if not contexts:
        if not collective:
            return []
        contexts, budgets = [[params.pad_token_id]], [0]
    device = next(engine.module.parameters()).device
    input_ids = pad_sequences_left(contexts, pad_value=params.pad_token_id).to(device)
    attention_mask = pad_sequences_left([[1] * len(c) for c in contexts], pad_value=0).to(device)
    position_ids = compute_position_ids(attention_mask)
    steps = params.response_length if collective else max(budgets)
    budget = torch.tensor(budgets, device=device)
    eos = torch.tensor(params.eos_ids, device=device)
    generator = engine._generator_for(device)
    batch = len(contexts)
    tokens_out = torch.full((batch, steps), params.pad_token_id, dtype=torch.long, device=device)
    logprobs_out = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    finished = budget <= 0
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    was_training = engine.module.training
    engine.module.eval()
    try:
        logits, cache = engine._forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        mask, next_pos = attention_mask, position_ids[:, -1:] + 1
        for step in range(steps):
            tokens, token_logprobs = sample_next_tokens(
                logits, params, generator=generator, logprobs_mode=engine.logprobs_mode
            )
            tokens = tokens.masked_fill(finished, params.pad_token_id)
            tokens_out[:, step] = tokens
            logprobs_out[:, step] = token_logprobs.masked_fill(finished, 0.0)
            lengths += (~finished).long()
            finished = finished | torch.isin(tokens, eos) | (lengths >= budget)
            if step == steps - 1 or engine._all_done(finished):
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            logits, cache = engine._forward(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos + step,
                past_key_values=cache,
            )
    finally:
        engine.module.train(was_training)
    return [
        Completion(tokens_out[i, : int(lengths[i])].tolist(), logprobs_out[i, : int(lengths[i])].tolist())
        for i in range(real)
    ]
