"""One forward pass of a causal LM to the log-probs (and entropy) of the response tokens.

Notation: b = rows of the micro-batch, T = P + R full length, R = response length, V = vocab, K = packed
positions predicting response tokens (remove-padding path).

The logit at column t predicts the token at column t + 1, so responses (columns T - R .. T - 1) are
predicted by columns T - R - 1 .. T - 2, i.e. ``logits[:, -R - 1 : -1]``. Only those positions go
through the LM head (``logits_to_keep``), which skips the prompt's share of the (b, T, V) logits. The
logits are cast to fp32 chunk by chunk before the temperature division and the log-softmax
(``rlhf_ops.algorithms.logprobs_and_entropy``). Without remove padding, the columns that are padding in every row
of the micro-batch are cut first (``workers.utils.trim_padding``).

Ulysses sequence parallelism (``sp_group`` of size sp > 1, remove-padding path only): each rank of the
group forwards its slice of the packed row (``workers.sp.shard_packed``), computes the log-probs of the kept
positions it holds, and the per-token results are gathered over the group before scattering to (b, R).
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import Tensor, nn

from rlhf_ops.algorithms import logprobs_and_entropy
from workers.sp.ulysses import sp_world_size
from workers.utils.forward_runner import forward_packed
from workers.utils.remove_padding import pack_sequences, scatter_response
from workers.utils.shared_prompt import pack_shared_prompts, shared_prompt_mask_dtype
from workers.utils.trim_padding import trim_padding_columns

__all__ = ["response_log_probs", "supports_logits_to_keep"]


def supports_logits_to_keep(module: nn.Module) -> bool:
    """Whether the model's forward accepts ``logits_to_keep`` (transformers >= 4.50 causal LMs)."""
    return "logits_to_keep" in inspect.signature(type(module).forward).parameters


def _padded_logits(
    module: nn.Module,
    *,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_length: int,
    keep_logits: bool,
    pixel_values: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(logits (b, R, V) of the positions predicting the response tokens, their labels (b, R)) of a padded batch."""
    extra: dict[str, Tensor | int] = {"logits_to_keep": response_length + 1} if keep_logits else {}  # (b, R + 1, V)
    if pixel_values is not None:
        extra["pixel_values"] = pixel_values.flatten(0, 1)
    out = module(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra
    )
    logits = out.logits[:, -response_length - 1 : -1]  # (b, R, V)
    return logits, input_ids[:, -response_length:]


def _token_log_probs(
    logits: Tensor, labels: Tensor, *, temperature: float, calculate_entropy: bool, entropy_requires_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``labels`` (...,) under ``logits`` (..., V), and the entropy when asked (both fp32).

    One fused chunked pass (``logprobs_and_entropy``): fp32 per chunk BEFORE the log-softmax (bf16 logits
    lose ~3 digits of the ratio), and no (..., V) fp32 copy of the logits kept for the backward.
    """
    log_probs, entropy = logprobs_and_entropy(logits, labels, temperature=temperature)
    if not calculate_entropy:
        return log_probs, None
    return log_probs, entropy if entropy_requires_grad else entropy.detach()


def response_log_probs(
    module: nn.Module,
    *,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    response_length: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    entropy_requires_grad: bool = False,
    use_remove_padding: bool = False,
    keep_logits: bool = True,
    sp_group: dist.ProcessGroup | None = None,
    pixel_values: Tensor | None = None,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropy) of the response tokens of one micro-batch.

    Args:
        module: Causal LM (FSDP-wrapped or not); returns ``.logits`` (b, T, V) or (b, k, V).
        input_ids: (b, T).
        attention_mask: (b, T).
        position_ids: (b, T).
        response_length: R.
        temperature: Logits are divided by it (the rollout's sampling temperature).
        calculate_entropy: Also return the token entropy.
        entropy_requires_grad: Keep the entropy in the autograd graph (entropy bonus); else computed
            under ``no_grad`` as a metric only.
        use_remove_padding: Forward on one packed row without pad tokens (see ``workers.utils.remove_padding``).
        keep_logits: Pass ``logits_to_keep`` (see :func:`supports_logits_to_keep`).
        sp_group: Ulysses group; with > 1 rank all its ranks call with the same micro-batch, the forward is
            packed, the model needs ``enable_ulysses_attention``, and with activation checkpointing a
            ``ulysses_sequence_parallel`` block must stay open around the backward (recomputed attention).
        pixel_values: (b, k, C, H, W) images of a vision-language policy (not with Ulysses), else None.
        share_prompts: Forward each distinct prompt of the micro-batch once (``workers.utils.shared_prompt``);
            falls back to the padded or packed forward when no prompt repeats (not with Ulysses or images).

    Returns:
        ``(log_probs (b, R) fp32, entropy (b, R) fp32 or None)``. Columns outside the response mask hold
        unspecified values (zeros, the pad token's log-prob, or the next packed sequence's token's); mask them.
    """
    stats = {"calculate_entropy": calculate_entropy, "entropy_requires_grad": entropy_requires_grad}
    sp = sp_world_size(sp_group) > 1
    if sp and pixel_values is not None:
        raise ValueError(
            "actor.ulysses_sequence_parallel_size > 1 does not shard image tokens; set it to 1 for a "
            "vision-language policy"
        )
    if not (use_remove_padding or sp or share_prompts):  # Ulysses always shards the packed row
        trim = trim_padding_columns(input_ids, attention_mask, position_ids, response_length=response_length)
        logits, labels = _padded_logits(
            module,
            input_ids=trim.input_ids,
            attention_mask=trim.attention_mask,
            position_ids=trim.position_ids,
            response_length=trim.response_length,
            keep_logits=keep_logits,
            pixel_values=pixel_values,
        )
        log_probs, entropy = _token_log_probs(logits, labels, temperature=temperature, **stats)
        return trim.restore(log_probs), None if entropy is None else trim.restore(entropy)
    packed = None
    if share_prompts and not sp and pixel_values is None:
        packed = pack_shared_prompts(
            input_ids,
            attention_mask,
            position_ids,
            response_length=response_length,
            mask_dtype=shared_prompt_mask_dtype(module),
        )
        if packed is None and not use_remove_padding:  # no prompt repeats: the padded forward as usual
            return response_log_probs(
                module,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                response_length=response_length,
                temperature=temperature,
                calculate_entropy=calculate_entropy,
                entropy_requires_grad=entropy_requires_grad,
                keep_logits=keep_logits,
            )
    if packed is None:
        packed = pack_sequences(input_ids, attention_mask, position_ids, response_length=response_length)
    media = None if pixel_values is None else {"pixel_values": pixel_values.flatten(0, 1)}
    fwd = forward_packed(module, packed, sp_group=sp_group, keep_logits=keep_logits, media=media)
    log_probs, entropy = _token_log_probs(fwd.outputs, fwd.labels, temperature=temperature, **stats)
    rows = input_ids.shape[0]
    log_probs = scatter_response(fwd.collect(log_probs), packed, batch_size=rows, response_length=response_length)
    if entropy is not None:
        entropy = scatter_response(fwd.collect(entropy), packed, batch_size=rows, response_length=response_length)
    return log_probs, entropy
