"""``AsyncRolloutWorker``: one process of the rollout group of ``trainer.pipeline=async``, not colocated with
the actor. It holds the ``rollout.engine`` entry of the engine table (``hf``: its own copy of the model, decoded
in this process; ``vllm``: a vLLM engine with its own weights, each pushed version loaded in place), takes
generation requests into a queue and generates them on a thread of its own, so its Ray methods (submit,
push_weights, poll, stats) answer at once.

Notation: B = rows of a request (prompts x n, repeated by the driver), R = ``max_new_tokens``, S =
``partial_rollout_tokens``, v = the policy version (actor updates the weights had seen).

Partial rollout: a request is generated S tokens at a time, each piece one ``generate_sequences`` call of the
engine. Between two pieces the worker takes the newest weights pushed to it (v grows) and continues the
unfinished rows with them: their prompt and the tokens so far are prefilled again under the new weights.
``token_policy_version`` (B, R) records the v that sampled each token and ``rollout_log_probs`` the log-prob
under those weights, so a token-level importance weight is exact.
A request never starts with weights older than its ``min_version`` (the driver's version when it was
admitted), so the lag of a batch is bounded by how far ahead the driver admits work.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_ops.config.schema import RolloutConfig
from rlhf_ops.padding import compute_position_ids, get_response_mask
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams, rollout_logprobs_mode
from workers.rollout.base import EngineContext, RolloutEngine, build_rollout_output, prompt_tensors

__all__ = ["AsyncRolloutWorker", "RolloutWorkerSpec", "read_weights", "write_weights"]


@dataclass(frozen=True, kw_only=True)
class RolloutWorkerSpec:
    """What a rollout worker needs, resolved by the driver."""

    model_path: str
    rollout: RolloutConfig
    pad_token_id: int
    eos_token_id: tuple[int, ...]
    max_prompt_length: int
    seed: int
    num_threads: int = 1
    partial_rollout: bool = True
    partial_rollout_tokens: int = 16
    attn_implementation: str = "eager"


@dataclass
class _Request:
    request_id: str
    prompts: DataProto
    sampling: SamplingParams
    min_version: int


def write_weights(state: dict[str, Tensor]) -> bytes:
    """``state`` as safetensors bytes (tensors that share memory, e.g. tied embeddings, are copied)."""
    from safetensors.torch import save

    seen: set[int] = set()
    flat = {}
    for name, value in state.items():
        tensor = value.detach().cpu().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        flat[name] = tensor
    return bytes(save(flat))


def read_weights(payload: bytes) -> dict[str, Tensor]:
    """The inverse of :func:`write_weights`."""
    from safetensors.torch import load

    return dict(load(payload))


class AsyncRolloutWorker:
    """One rollout process (a Ray actor with ``max_concurrency`` > 1, or an in-process object in tests)."""

    def __init__(self, spec: RolloutWorkerSpec) -> None:
        from transformers import AutoModelForCausalLM

        from rlhf_ops.extensions import ROLLOUT_ENGINES

        torch.set_num_threads(spec.num_threads)  # before a vLLM CPU engine makes set_num_threads a no-op
        self.spec = spec
        r = spec.rollout
        entry = ROLLOUT_ENGINES.get(r.engine)
        # The HF engine decodes with a module handed to it; an engine with weights of its own (vLLM) loads them
        # from the model folder and takes every pushed version through update_weights.
        model = None
        if entry.needs_module:
            model = AutoModelForCausalLM.from_pretrained(
                spec.model_path, dtype=torch.float32, attn_implementation=spec.attn_implementation
            )
        context = EngineContext(
            model_path=spec.model_path,
            config=r,
            pad_token_id=spec.pad_token_id,
            eos_token_id=spec.eos_token_id,
            seed=spec.seed,
            device="cpu",
            max_prompt_length=spec.max_prompt_length,
            logprobs_mode=rollout_logprobs_mode(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
            module=model,
        )
        self.engine: RolloutEngine = entry.load()(context)
        self.version = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._results: list[tuple[str, DataProto]] = []
        self._weights: tuple[int, dict[str, Tensor]] | None = None  # the newest pushed, not applied yet
        self._busy_s = self._idle_s = 0.0
        self._cuts = 0  # requests continued under newer weights (partial rollout)
        self._tokens = 0  # response tokens generated (the rows' model tokens, EOS included)
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="async-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- methods
    def submit(
        self, request_id: str, prompts: DataProto, sampling: SamplingParams, min_version: int, front: bool = False
    ) -> None:
        """Queues a request (``front``: before the others, e.g. a dropped batch generated again)."""
        request = _Request(request_id, prompts.to("cpu"), sampling, min_version)
        with self._cond:
            self._queue.appendleft(request) if front else self._queue.append(request)
            self._cond.notify_all()

    def push_weights(self, weights: dict[str, Tensor] | bytes | str, version: int) -> None:
        """Keeps ``weights`` (a state dict, safetensors bytes, or a URL of a safetensors file: read here, so the
        caller may delete it once this returns) to be taken at the next piece boundary."""
        payload: dict[str, Tensor] | bytes | bytearray
        if isinstance(weights, str):
            from rlhf_ops.storage.stores import open_store

            fs, path = open_store(weights)
            with fs.open(path, "rb") as f:
                payload = f.read()
        else:
            payload = weights
        state = read_weights(bytes(payload)) if isinstance(payload, bytes | bytearray) else dict(payload)
        with self._cond:
            if self._weights is None or version > self._weights[0]:
                self._weights = (version, state)
            self._cond.notify_all()

    def poll(self, timeout_s: float = 0.0) -> list[tuple[str, DataProto]]:
        """Finished requests since the last poll, waiting up to ``timeout_s`` for one.

        Raises:
            RuntimeError: the generation thread failed (its error is chained).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._results and self._error is None and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._error is not None:
                raise RuntimeError(f"the rollout worker's generation failed: {self._error!r}") from self._error
            out, self._results = self._results, []
        return out

    def stats(self) -> dict[str, float]:
        """Cumulative seconds generating and idle, response tokens generated, the version in use, pieces continued
        under newer weights."""
        with self._cond:
            busy, idle, tokens = self._busy_s, self._idle_s, float(self._tokens)
            return {
                "busy_s": busy,
                "idle_s": idle,
                "tokens": tokens,
                "version": float(self.version),
                "cuts": float(self._cuts),
            }

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------- thread
    def _take_weights(self) -> bool:
        """Applies the newest pushed weights (called with the lock held); True when the version changed."""
        if self._weights is None:
            return False
        version, state = self._weights
        self._weights = None
        self.engine.update_weights(state.items())
        changed = version != self.version
        self.version = version
        return changed

    def _next_request(self) -> _Request | None:
        with self._cond:
            start = time.perf_counter()
            while not self._stopped:
                self._take_weights()
                if self._queue and self.version >= self._queue[0].min_version:
                    self._idle_s += time.perf_counter() - start
                    return self._queue.popleft()
                self._cond.wait(0.5)
            return None

    def _loop(self) -> None:
        try:
            while (request := self._next_request()) is not None:
                start = time.perf_counter()
                out = self._generate(request)
                with self._cond:
                    self._busy_s += time.perf_counter() - start
                    self._tokens += int(out.tensors["response_mask"].sum())
                    self._results.append((request.request_id, out))
                    self._cond.notify_all()
        except BaseException as exc:  # reported by the next poll
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _generate(self, request: _Request) -> DataProto:
        """The request's rows, S tokens at a time (all R at once without partial rollout)."""
        ids, mask, _ = prompt_tensors(request.prompts)
        params = request.sampling
        rows, length, pad = ids.shape[0], params.response_length, params.pad_token_id
        piece = self.spec.partial_rollout_tokens if self.spec.partial_rollout else length
        responses = torch.full((rows, length), pad, dtype=torch.long)
        log_probs = torch.zeros((rows, length), dtype=torch.float32)
        versions = torch.zeros((rows, length), dtype=torch.long)
        done = torch.zeros(rows, dtype=torch.bool)
        eos = torch.tensor(params.eos_ids)
        made = 0
        while made < length and not bool(done.all()):
            if made:  # a piece boundary: newer weights continue the unfinished rows
                with self._cond:
                    self._cuts += int(self._take_weights())
            active = (~done).nonzero().squeeze(-1)
            size = min(piece, length - made)
            a_mask = torch.cat([mask[active], mask.new_ones(len(active), made)], dim=1)
            tensors = {
                "input_ids": torch.cat([ids[active], responses[active, :made]], dim=1),
                "attention_mask": a_mask,
                "position_ids": compute_position_ids(a_mask),
            }
            out = self.engine.generate_sequences(
                DataProto.from_dict(tensors), dataclasses.replace(params, n=1, response_length=size)
            )
            got = out.tensors["responses"]
            responses[active, made : made + size] = got
            log_probs[active, made : made + size] = out.tensors["rollout_log_probs"]
            versions[active, made : made + size] = self.version
            done[active] |= torch.isin(got, eos).any(-1)
            made += size
        response_mask = get_response_mask(responses, eos_token_id=params.eos_ids)
        result = build_rollout_output(
            ids,
            mask,
            responses=responses,
            response_mask=response_mask,
            log_probs=log_probs,
            columns=request.prompts.non_tensor_batch,
            n=1,
        )
        result.tensors["token_policy_version"] = versions * response_mask.long()
        return result
