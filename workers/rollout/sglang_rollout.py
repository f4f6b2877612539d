"""The ``sglang`` entry of the engine table: SGLang's offline ``Engine`` as a rollout engine.

The engine holds its own copy of the weights (like vLLM): the actor worker's sharding manager pushes the
actor's full tensors through :meth:`SGLangRollout.update_weights` (SGLang's ``update_weights_from_tensor``)
before a rollout that follows an update, and :meth:`release` / :meth:`resume` free and re-take its GPU memory
between rollouts (``release_memory_occupation`` / ``resume_memory_occupation``). Generation is by token ids
(``skip_tokenizer_init``), ``n`` samples per prompt as ``n`` requests with per-request seeds drawn from
(seed, step), so a resumed run samples as an uninterrupted one; the recorded log-probs are SGLang's
``output_token_logprobs`` (the sampled tokens' log-probs).

``sglang`` is imported when an engine is built, never at module import, so this module (and its config path)
loads where SGLang is not installed. It has not run on this project's machines (CPU-only; SGLang's PyPI wheels
carry CUDA kernels only): the pre-flight refuses ``rollout.engine=sglang`` where the package does not import.

Notation: B prompts, n samples per prompt, P prompt length (left-padded), R = ``response_length``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlhf_ops.config.schema import RolloutConfig
from rlhf_ops.padding import get_response_mask
from rlhf_ops.protocol import DataProto
from workers.rollout.base import EngineContext, SamplingParams, build_rollout_output, prompt_tensors


def sampling_request(params: SamplingParams, *, seed: int) -> dict[str, Any]:
    """SGLang's per-request ``sampling_params`` for one sample (greedy: temperature 0)."""
    request: dict[str, Any] = {
        "max_new_tokens": params.response_length,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.eos_ids),
        "sampling_seed": seed,
    }
    return request


def pad_outputs(
    outputs: Sequence[dict[str, Any]], *, response_length: int, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(responses (B*n, R) long, log_probs (B*n, R) fp32, lengths (B*n,))`` from SGLang's results.

    Each result has ``output_ids`` and ``meta_info["output_token_logprobs"]`` (one ``(logprob, token_id, _)``
    per generated token); rows are right-padded with ``pad_token_id`` (log-prob 0) to exactly R columns.
    """
    rows = len(outputs)
    responses = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
    lengths = torch.zeros(rows, dtype=torch.long)
    for i, out in enumerate(outputs):
        ids = list(out["output_ids"])[:response_length]
        lps = [float(item[0]) for item in out["meta_info"]["output_token_logprobs"]][: len(ids)]
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        lengths[i] = len(ids)
    return responses, log_probs, lengths


class SGLangRollout:
    """:class:`~workers.rollout.base.RolloutEngine` backed by an in-process ``sglang.Engine``.

    Args:
        model_path: Local HF model directory.
        config: The rollout section (dtype, memory share, TP size, default sampling).
        pad_token_id: Id written after EOS.
        eos_token_id: Id(s) ending a response.
        seed: Seed of the engine and of the per-request sampling seeds.
        device: ``"cuda"`` (SGLang's CPU backend needs a CPU build of sgl-kernel).
        engine: An already built engine (tests); None builds ``sglang.Engine`` from the arguments.
    """

    def __init__(
        self,
        model_path: str,
        *,
        config: RolloutConfig,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        seed: int,
        device: str,
        engine: Any = None,
    ) -> None:
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        self.defaults = SamplingParams(
            n=1,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            response_length=config.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad_token_id,
        )
        self.seed = seed
        self._seeds = random.Random(seed)
        self._released = False
        self.engine = engine if engine is not None else _build_sglang_engine(model_path, config, seed, device)

    @property
    def weights_released(self) -> bool:
        """Always False: SGLang keeps its weights in host memory while released, and resume restores them."""
        return False

    def _requests(self, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams) -> dict[str, Any]:
        """The ``generate`` arguments: each prompt's real tokens, repeated n times (samples stay adjacent)."""
        prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask, strict=True)]
        ids = [p for p in prompts for _ in range(params.n)]
        sampling = [sampling_request(params, seed=self._seeds.randrange(2**31)) for _ in ids]
        return {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}

    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Samples ``n`` responses per prompt (keys and shapes: :mod:`workers.rollout.base`)."""
        start = time.perf_counter()
        params = self.defaults if sampling is None else sampling
        if step is not None:
            self._seeds = random.Random(self.seed * 1_000_003 + step)
        input_ids, attention_mask, _ = prompt_tensors(prompts)
        outputs = self.engine.generate(**self._requests(input_ids, attention_mask, params))
        return self._output(prompts, input_ids, attention_mask, outputs, params, start)

    def _output(
        self,
        prompts: DataProto,
        input_ids: Tensor,
        attention_mask: Tensor,
        outputs: Sequence[dict[str, Any]],
        params: SamplingParams,
        start: float,
    ) -> DataProto:
        responses, log_probs, lengths = pad_outputs(
            outputs, response_length=params.response_length, pad_token_id=params.pad_token_id
        )
        valid = torch.arange(params.response_length) < lengths.unsqueeze(-1)
        out = build_rollout_output(
            input_ids.repeat_interleave(params.n, dim=0),
            attention_mask.repeat_interleave(params.n, dim=0),
            responses=responses.to(input_ids.device),
            response_mask=(get_response_mask(responses, eos_token_id=params.eos_ids) * valid).to(input_ids.device),
            log_probs=log_probs.to(input_ids.device),
            columns=prompts.non_tensor_batch,
            n=params.n,
        )
        out.meta_info["timing"] = {"generate_sequences": time.perf_counter() - start}
        return out

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Loads (name, full tensor) pairs in HF naming, bucket by bucket, and flushes the prefix cache."""
        for name, tensor in weights:
            self.engine.update_weights_from_tensor(named_tensors=[(name, tensor)], flush_cache=False)
        self.engine.flush_cache()

    def release(self) -> None:
        """Frees the engine's GPU memory (weights and KV cache) while the actor trains."""
        if not self._released:
            self.engine.release_memory_occupation()
            self._released = True

    def resume(self) -> None:
        """Re-takes the memory :meth:`release` freed, before the next rollout."""
        if self._released:
            self.engine.resume_memory_occupation()
            self._released = False


class AsyncSGLangRollout(SGLangRollout):
    """The async mode: the same engine's ``async_generate``, one request per sample, run to completion here."""

    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        start = time.perf_counter()
        params = self.defaults if sampling is None else sampling
        if step is not None:
            self._seeds = random.Random(self.seed * 1_000_003 + step)
        input_ids, attention_mask, _ = prompt_tensors(prompts)
        request = self._requests(input_ids, attention_mask, params)
        outputs = asyncio.run(self.engine.async_generate(**request))
        return self._output(prompts, input_ids, attention_mask, outputs, params, start)


def _build_sglang_engine(model_path: str, config: RolloutConfig, seed: int, device: str) -> Any:
    try:
        import sglang
    except ImportError as err:
        raise RuntimeError(
            f"rollout.engine=sglang needs the 'sglang' package ({err}); install it on the workers' image (GPU), "
            "or set rollout.engine=vllm or hf"
        ) from err
    return sglang.Engine(
        model_path=model_path,
        dtype=config.dtype,
        tp_size=config.tensor_model_parallel_size,
        mem_fraction_static=config.gpu_memory_utilization,
        random_seed=seed,
        skip_tokenizer_init=True,
        enable_memory_saver=config.free_cache_engine,
        device=device,
    )


def build_engine(ctx: EngineContext) -> SGLangRollout:
    """The ``sglang`` entry of the engine table (``rollout.mode=sync``)."""
    return SGLangRollout(
        ctx.model_path,
        config=ctx.config,
        pad_token_id=ctx.pad_token_id,
        eos_token_id=ctx.eos_token_id,
        seed=ctx.seed,
        device=ctx.device,
    )


def build_async_engine(ctx: EngineContext) -> AsyncSGLangRollout:
    """The ``sglang`` entry's async engine (``rollout.mode=async``)."""
    return AsyncSGLangRollout(
        ctx.model_path,
        config=ctx.config,
        pad_token_id=ctx.pad_token_id,
        eos_token_id=ctx.eos_token_id,
        seed=ctx.seed,
        device=ctx.device,
    )
