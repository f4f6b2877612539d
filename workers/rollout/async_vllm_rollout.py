"""Rollout engine on vLLM's ``AsyncLLM`` (``rollout.mode=async``): one request per sample, continuous batching.

Same contract, keys, shapes, sampling seeds and log-probs as :class:`~workers.rollout.vllm_rollout.VLLMRollout`
(it is a subclass: only the engine and how requests reach it differ). Findings and design:
``docs/async_rollout.md``.

How it runs:
- vLLM 0.32's ``AsyncLLM`` always runs its engine core in **another process** (ZeroMQ between the two, on
  the CPU build too). This object owns an asyncio event loop on a background thread of the worker process;
  the engine is built on that loop and every ``async def`` here runs there. The synchronous
  :meth:`generate_sequences` (the worker-group contract) submits its coroutine to the loop and waits.
- Generation: every row (prompt x sample) is its own request (:meth:`generate_one`), all submitted at once
  and gathered in request order (:meth:`agenerate`); the engine core schedules them by continuous
  batching and each finishes on its own (``RequestOutputKind.FINAL_ONLY``: one message per request).
  The agent loop (``rollout.multi_turn``) runs one coroutine per sample on this loop, each awaiting
  :meth:`generate_one` for its turns (``workers/rollout/multi_turn.py``).
- Weights: a generator cannot cross the process boundary, and tensors in ``collective_rpc`` arguments
  arrive as raw ``[dtype, shape, buffer]`` lists (vLLM's msgpack decoder only rebuilds tensors where a type
  hint says so). So :meth:`update_weights` writes the streamed tensors into safetensors files under a
  folder in ``/dev/shm`` (files of at most ``weight_file_bytes``, the trainer's extra memory stays one
  file) and calls ``collective_rpc("reload_weights", kwargs={"weights_path": folder})`` once: the engine
  reads them (mmap) and reloads in place with vLLM's post-processing (CPU repacking), then the files are
  deleted and the prefix cache is reset.
- Memory: GPU with ``free_cache_engine``: :meth:`release` puts the engine to sleep (level 1), :meth:`resume`
  wakes the weights only (the sync writes into them), and the KV cache wakes at the next generation, so
  weights + KV cache never coexist with the optimizer state. CPU (no sleep mode in vLLM): both are no-ops;
  the prefix cache is reset after every weight update instead.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from torch import Tensor

from rlhf_ops.config.schema import RolloutConfig
from workers.rollout.base import EngineContext, LogprobsMode
from workers.rollout.vllm_rollout import VLLMRollout, _preserve_global_rng

__all__ = ["AsyncVLLMRollout"]

T = TypeVar("T")
_SHM = Path("/dev/shm")


class AsyncVLLMRollout(VLLMRollout):
    """:class:`~workers.rollout.base.RolloutEngine` backed by a ``vllm.v1.engine.async_llm.AsyncLLM``.

    Args:
        model_path, config, pad_token_id, eos_token_id, seed, device, max_prompt_length, logprobs_mode,
        load_format: as :class:`~workers.rollout.vllm_rollout.VLLMRollout`.
        weight_dir: Parent folder of the weight files handed to the engine process (None: ``/dev/shm`` when
            it exists, else the system temp folder). It needs room for one copy of the model in
            ``rollout.dtype``; a container's default 64 MiB ``/dev/shm`` is too small for real models.
        weight_file_bytes: Most bytes per weight file (the trainer-side buffer while writing).

    Raises:
        ValueError: ``tensor_model_parallel_size`` > 1 (one engine per rank here), or as ``VLLMRollout``.
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
        max_prompt_length: int | None = None,
        logprobs_mode: LogprobsMode = "raw",
        load_format: str = "auto",
        weight_dir: str | os.PathLike[str] | None = None,
        weight_file_bytes: int = 256 << 20,
    ) -> None:
        if config.tensor_model_parallel_size != 1:
            raise ValueError(
                f"rollout.tensor_model_parallel_size={config.tensor_model_parallel_size} with rollout.mode=async: "
                "the async engine runs one engine per rank; set it to 1."
            )
        if weight_file_bytes < 1:
            raise ValueError(f"weight_file_bytes={weight_file_bytes} must be >= 1.")
        default = _SHM if _SHM.is_dir() else Path(tempfile.gettempdir())
        self.weight_parent = Path(weight_dir) if weight_dir is not None else default
        self.weight_prefix = f"rlhf-weights-{os.getpid()}-"  # one folder per update, removed after the reload
        self.weight_file_bytes = weight_file_bytes
        self.last_weight_files = 0  # files written by the last update_weights
        self._request_ids = itertools.count()
        self._kv_asleep = False
        self._wake_lock = asyncio.Lock()  # concurrent requests (the agent loop's samples) wake the KV cache once
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-loop", daemon=True)
        self._thread.start()
        try:
            super().__init__(
                model_path,
                config=config,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_id,
                seed=seed,
                device=device,
                max_prompt_length=max_prompt_length,
                logprobs_mode=logprobs_mode,
                load_format=load_format,
                weight_loader="reload",
            )
        except BaseException:
            self._stop_loop()
            raise

    # ------------------------------------------------------------------------------------------- engine
    def _executor_backend(self, requested: str | None) -> str | None:
        # The engine core is its own process with its own (TP 1) vLLM world: never the trainer's launcher.
        return None

    def _start_engine(self, model_path: str, config: RolloutConfig, *, logprobs_mode: str, load_format: str) -> None:
        kwargs = self._engine_kwargs(config, logprobs_mode=logprobs_mode, load_format=load_format)
        # A forked engine core would inherit the trainer's torch.distributed group (vLLM then reuses it as its
        # own world) and the loop thread: spawn it (vLLM forces spawn in Ray actors and under CUDA anyway).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

        async def build() -> Any:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            # Built on the loop: the engine's output handler task starts on it, and every call runs there.
            return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_path, **kwargs))

        with _preserve_global_rng():
            self.engine = self._run(build())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the engine's event loop and waits for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _sampling_params(self, params: Any, seed: int) -> Any:
        from vllm.sampling_params import RequestOutputKind

        sampling = super()._sampling_params(params, seed)
        sampling.output_kind = RequestOutputKind.FINAL_ONLY  # one message per request, when it finishes
        return sampling

    # ------------------------------------------------------------------------------------------- generation
    async def generate_one(self, request_id: str, prompt_ids: list[int], sampling: Any) -> Any:
        """One request (token ids in, ``vllm.RequestOutput`` out); returns when this request finishes."""
        from vllm.inputs import TokensPrompt

        await self._ensure_kv_awake()
        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), sampling, request_id):
            final = output
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM request {request_id} ended without a finished output.")
        return final

    async def agenerate(self, prompts: list[list[int]], sampling: list[Any]) -> list[Any]:
        """Submits every prompt as its own request at once; ``RequestOutput``s in the order of ``prompts``."""
        await self._ensure_kv_awake()
        base = next(self._request_ids)
        pairs = enumerate(zip(prompts, sampling, strict=True))
        return list(await asyncio.gather(*(self.generate_one(f"rlhf-{base}-{i}", p, s) for i, (p, s) in pairs)))

    def generate_token_ids(self, prompts: list[list[int]], sampling: list[Any]) -> list[Any]:
        """Synchronous :meth:`agenerate` (what ``generate_sequences`` and the agent loop call)."""
        return self._run(self.agenerate(prompts, sampling))

    # ------------------------------------------------------------------------------------------- weights
    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Writes (name, full tensor) pairs into safetensors files, then one in-place reload in the engine.

        Send the whole model (the reload rebuilds every layer from what it receives). The files are removed
        once the engine has loaded them; the prefix cache is reset (its KV came from the old weights).
        """
        folder = Path(tempfile.mkdtemp(prefix=self.weight_prefix, dir=self.weight_parent))
        try:
            self._write_weight_files(weights, folder)
            self._run(
                self.engine.collective_rpc(
                    "reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True}
                )
            )
        finally:  # also when the worker dies later: nothing of this update stays in tmpfs
            shutil.rmtree(folder, ignore_errors=True)
        self._run(self.engine.reset_prefix_cache())

    def _write_weight_files(self, weights: Iterable[tuple[str, Tensor]], folder: Path) -> list[Path]:
        from safetensors.torch import save_file

        files: list[Path] = []
        chunk: dict[str, Tensor] = {}
        size = 0

        def flush() -> None:
            nonlocal chunk, size
            path = folder / f"model-{len(files):05d}.safetensors"
            save_file(chunk, str(path))
            files.append(path)
            chunk, size = {}, 0

        for name, tensor in weights:
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and size + nbytes > self.weight_file_bytes:
                flush()
            cpu = tensor.detach().to("cpu").contiguous()
            if any(cpu.data_ptr() == other.data_ptr() for other in chunk.values()):
                cpu = cpu.clone()  # a tied tensor sent under two names: safetensors refuses shared storage
            chunk[name] = cpu
            size += nbytes
        if chunk:
            flush()
        if not files:
            raise ValueError("update_weights got no tensors; send the whole model.")
        self.last_weight_files = len(files)
        return files

    # ------------------------------------------------------------------------------------------- memory
    def release(self) -> None:
        """GPU with ``free_cache_engine``: sleep level 1 (weights to host memory, KV cache freed). Else no-op."""
        if self.sleep_enabled and not self._asleep:
            self._run(self.engine.sleep(level=1))
            self._asleep, self._kv_asleep = True, True

    def resume(self) -> None:
        """Wakes the weights only (the sync writes into them); the KV cache wakes at the next generation."""
        if self._asleep:
            self._run(self.engine.wake_up(tags=["weights"]))
            self._asleep = False

    async def _ensure_kv_awake(self) -> None:
        async with self._wake_lock:
            if self._kv_asleep:
                await self.engine.wake_up(tags=["kv_cache"])
                await self.engine.reset_prefix_cache()
                self._kv_asleep = False

    def shutdown(self) -> None:
        """Stops the engine-core process and the event loop."""
        try:
            self.engine.shutdown()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


def build_engine(ctx: EngineContext) -> AsyncVLLMRollout:
    """The ``vllm`` entry's async engine (``rollout.mode=async``): an ``AsyncLLM``, one request per sample."""
    return AsyncVLLMRollout(
        ctx.model_path,
        config=ctx.config,
        pad_token_id=ctx.pad_token_id,
        eos_token_id=ctx.eos_token_id,
        seed=ctx.seed,
        device=ctx.device,
        max_prompt_length=ctx.max_prompt_length,
        logprobs_mode=ctx.logprobs_mode,
    )
