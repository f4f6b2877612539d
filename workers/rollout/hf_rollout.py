"""Rollout engine on a plain (or FSDP2-wrapped) HF causal LM: prefill, then one token at a time.

Notation: B = rows after repeating each prompt n times, P = prompt length, R = response length, V = vocab.

Why our own decode loop and not ``model.generate``: the recorded log-prob of each sampled token comes
from the same float32 logits the token was drawn from, sampling is ours (temperature / top-k / top-p /
greedy, one seeded ``torch.Generator``), and every row runs exactly the steps of the batch, which an
FSDP2 module needs (each forward all-gathers parameters on every rank). The KV cache is the model's own
(``use_cache=True`` returns a ``DynamicCache`` in ``past_key_values``), so this works for any HF causal
LM whose forward takes ``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values``,
``use_cache`` and ``logits_to_keep`` (transformers >= 4.45).

Vision-language policies (LLaVA-style): a batch with ``pixel_values`` (B, k, C, H, W) passes them to the
prefill only (the image features are then in the KV cache) and returns them, repeated like the rows, so
the actor's log-prob and update forwards see the same images.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_ops.padding import get_response_mask
from rlhf_ops.protocol import DataProto
from workers.rollout.base import EngineContext, LogprobsMode, SamplingParams, build_rollout_output, prompt_tensors
from workers.rollout.sampling import sample_next_tokens


def _is_fsdp(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)


class HFRollout:
    """:class:`~workers.rollout.base.RolloutEngine` that decodes with the policy module itself.

    Args:
        module: HF causal LM (``LlamaForCausalLM``, a PEFT model, an FSDP2-wrapped model...). Put in eval
            mode while generating, then restored.
        pad_token_id: Id written after EOS (the default settings' ``pad_token_id``).
        eos_token_id: Id(s) ending a response (the default settings' ``eos_token_id``).
        response_length: Default R (a call's ``sampling.response_length`` overrides it).
        temperature: Default temperature.
        top_p: Default nucleus mass.
        top_k: Default top-k (-1 disables).
        do_sample: Default; False decodes greedily.
        seed: Seed of the engine's generator; two engines with equal seeds and equal calls sample equally.
            A call with a ``step`` reseeds it from (seed, step) first, so a run
            resumed from a checkpoint samples exactly what an uninterrupted one would.
        logprobs_mode: What ``rollout_log_probs`` holds (see :mod:`workers.rollout.base`).
        sync_stop: Stop decoding only when every rank's rows have finished (an all-reduce per step), so that
            all ranks run the same number of forwards. None: on iff ``module`` is FSDP2-wrapped and
            ``torch.distributed`` is initialised. All ranks of the default group must then generate together.
        suppress_token_ids: Ids never sampled (their logits are set to -inf before sampling, and the recorded
            log-probs come from those logits): a VLM's image placeholder token, which in a response would be
            read as an image slot by the next forward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        response_length: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        do_sample: bool = True,
        seed: int = 0,
        logprobs_mode: LogprobsMode = "raw",
        sync_stop: bool | None = None,
        suppress_token_ids: Sequence[int] = (),
    ) -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode={logprobs_mode!r} must be 'raw' or 'processed'.")
        self.module = module
        self.defaults = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            do_sample=do_sample,
            response_length=response_length,
            eos_token_id=eos_token_id if isinstance(eos_token_id, int) else tuple(eos_token_id),
            pad_token_id=pad_token_id,
        )
        self.seed = seed
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._sync_stop = sync_stop
        self.suppress_token_ids = tuple(int(i) for i in suppress_token_ids)
        self._generator: torch.Generator | None = None

    # ------------------------------------------------------------------------------------------- contract
    def generate_sequences(
        self, prompts: DataProto, sampling: SamplingParams | None = None, step: int | None = None
    ) -> DataProto:
        """Samples ``n`` responses per prompt with ``sampling`` (None: :attr:`defaults`), reseeded by ``step``;
        keys and shapes in :mod:`workers.rollout.base`.

        Raises:
            ValueError: if ``input_ids`` / ``attention_mask`` / ``position_ids`` are missing or not (B, P),
                or a sampling value is invalid.
        """
        start = time.perf_counter()
        params = self.defaults if sampling is None else sampling
        input_ids, attention_mask, position_ids = prompt_tensors(prompts)
        assert prompts.batch is not None
        pixel_values = prompts.batch["pixel_values"] if "pixel_values" in prompts.batch.keys() else None
        if step is not None:
            # Reseeded from (seed, step) rather than continued: the generator's state is not checkpointed, so a
            # run resumed at step k samples step k + 1 exactly as the uninterrupted run did only if the state
            # is a function of the step alone.
            self._generator = torch.Generator(device=input_ids.device).manual_seed(self.seed * 1_000_003 + step)
        if params.n > 1:  # row i of the output is sample i % n of prompt i // n
            input_ids, attention_mask, position_ids = (
                t.repeat_interleave(params.n, dim=0) for t in (input_ids, attention_mask, position_ids)
            )
            if pixel_values is not None:
                pixel_values = pixel_values.repeat_interleave(params.n, dim=0)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                responses, logprobs = self._decode(
                    input_ids, attention_mask, position_ids, params, pixel_values=pixel_values
                )
        finally:
            self.module.train(was_training)
        out = build_rollout_output(
            input_ids,
            attention_mask,
            responses=responses,
            response_mask=get_response_mask(responses, eos_token_id=params.eos_ids),
            log_probs=logprobs,
            columns=prompts.non_tensor_batch,
            n=params.n,
            pixel_values=pixel_values,
        )
        out.meta_info["timing"] = {"generate_sequences": time.perf_counter() - start}
        return out

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copies (name, tensor) pairs into the module's parameters and buffers, in place.

        Not needed when the engine decodes with the training module itself (the usual HF setup): it
        already holds the new weights. For a separate inference copy, pass the trainer's full state dict.

        Raises:
            ValueError: on a name the module does not have, or a shape mismatch.
        """
        # Every name of a tied parameter (lm_head.weight is embed_tokens.weight): the sync sends both.
        targets: dict[str, Tensor] = dict(self.module.named_parameters(remove_duplicate=False))
        targets.update(dict(self.module.named_buffers()))
        with torch.no_grad():
            for name, value in weights:
                if name not in targets:
                    raise ValueError(f"update_weights got {name!r}, which the rollout module lacks; send HF names.")
                if targets[name].shape != value.shape:
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(value.shape)}, the module expects "
                        f"{tuple(targets[name].shape)}; send full (unsharded) tensors."
                    )
                targets[name].copy_(value)

    weights_released = False  # it decodes with the policy module itself

    def release(self) -> None:
        """No-op: the HF engine holds no memory beyond the module and the per-call KV cache."""

    def resume(self) -> None:
        """No-op (see :meth:`release`)."""

    # ------------------------------------------------------------------------------------------- internals
    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def _all_done(self, finished: Tensor) -> bool:
        done = finished.all()
        sync = self._sync_stop
        if sync is None:
            sync = _is_fsdp(self.module) and torch.distributed.is_initialized()
        if sync:
            flag = done.to(torch.int32)  # MIN over ranks: stop only when every rank is done
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            done = flag.bool()
        return bool(done)

    def _forward(self, **kwargs: Any) -> tuple[Tensor, Any]:
        out = self.module(use_cache=True, logits_to_keep=1, **kwargs)
        logits = out.logits[:, -1, :]  # (B, V) next-token logits
        if self.suppress_token_ids:
            logits = logits.index_fill(-1, torch.tensor(self.suppress_token_ids, device=logits.device), float("-inf"))
        return logits, out.past_key_values  # the grown cache

    def _decode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        params: SamplingParams,
        *,
        pixel_values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Prefill then R single-token steps. Returns responses (B, R) int64 and log-probs (B, R) float32.

        ``pixel_values`` (B, k, C, H, W) go to the prefill only, flattened to (B * k, C, H, W).
        """
        batch, length = input_ids.shape[0], params.response_length
        device = input_ids.device
        generator = self._generator_for(device)
        eos = torch.tensor(params.eos_ids, device=device)
        responses = torch.full((batch, length), params.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, length), dtype=torch.float32, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        next_pos = position_ids[:, -1:] + 1  # (B, 1): left padding puts every prompt's last token in column P-1
        media = {} if pixel_values is None else {"pixel_values": pixel_values.flatten(0, 1)}
        logits, cache = self._forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **media
        )
        mask = attention_mask
        for step in range(length):
            tokens, token_logprobs = sample_next_tokens(
                logits, params, generator=generator, logprobs_mode=self.logprobs_mode
            )
            tokens = tokens.masked_fill(finished, params.pad_token_id)  # finished rows emit padding
            responses[:, step] = tokens
            logprobs[:, step] = token_logprobs.masked_fill(finished, 0.0)
            finished |= torch.isin(tokens, eos)
            if step == length - 1 or self._all_done(finished):
                break
            # Attend to every generated token, padding of finished rows included: those rows' outputs are
            # discarded, and unfinished rows never see other rows.
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            logits, cache = self._forward(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=next_pos + step,
                past_key_values=cache,
            )
        return responses, logprobs


def build_engine(ctx: EngineContext) -> HFRollout:
    """The ``hf`` entry of the engine table: generation on the actor's own module (no weight copy)."""
    r = ctx.config
    return HFRollout(
        ctx.module,
        pad_token_id=ctx.pad_token_id,
        eos_token_id=ctx.eos_token_id,
        response_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        logprobs_mode=ctx.logprobs_mode,
        seed=ctx.seed,
        suppress_token_ids=ctx.suppress_token_ids,
    )
