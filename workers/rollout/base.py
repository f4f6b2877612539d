"""The rollout engine contract every engine follows (the Protocol :class:`rlhf_ops.extensions.RolloutEngine`, built
from one :class:`rlhf_ops.extensions.rollout.EngineContext`), and the helpers engines share.

Notation: B = prompts in the request, n = samples per prompt, P = prompt length (left-padded),
R = ``response_length`` (responses are always padded to exactly R columns, as in verl), T = P + R.

``generate_sequences`` input (a :class:`~rlhf_ops.protocol.DataProto`):
    tensors ``input_ids`` (B, P) left-padded, ``attention_mask`` (B, P), ``position_ids`` (B, P);
    any non-tensor columns (carried to the output, repeated n times). The call's settings are typed arguments,
    never ``meta_info`` entries: ``sampling`` (a :class:`SamplingParams`: ``n``, ``temperature``, ``top_p``,
    ``top_k``, ``do_sample``, ``response_length`` (max new tokens), ``eos_token_id``, ``pad_token_id``; None:
    the engine's defaults) and ``step`` (reseeds the engine from (seed, step), so a resumed run samples what
    an uninterrupted one would; None: the generator continues).

Output (B * n rows; the n samples of a prompt are adjacent, like ``DataProto.repeat(n, interleave=True)``):
    ``prompts`` (B*n, P), ``responses`` (B*n, R) right-padded with ``pad_token_id`` after the first EOS,
    ``input_ids`` / ``attention_mask`` / ``position_ids`` (B*n, T) from
    :func:`rlhf_ops.padding.build_full_sequence`, ``response_mask`` (B*n, R) (1 up to and including the
    first EOS), ``rollout_log_probs`` (B*n, R) float32, 0 on masked tokens; ``meta_info["timing"]``.

``rollout_log_probs`` are, by default (``logprobs_mode="raw"``), log-probs of the sampled tokens under the
raw model distribution at temperature 1: ``log_softmax(logits)``, before temperature, top-k and top-p.
That is vLLM's default (``logprobs_mode="raw_logprobs"``) and equals the actor's recomputed
``old_log_probs`` when the actor uses temperature 1. ``"processed"`` records ``log_softmax`` of the
logits actually sampled from (divided by temperature, top-k / top-p filtered to -inf), vLLM's
``processed_logprobs``: the exact behaviour-policy log-prob for importance-sampling corrections.
Note the actor recomputes ``log_softmax(logits / temperature)`` without filtering, which equals neither
mode when temperature != 1 and top-k / top-p are on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from torch import Tensor

from rlhf_ops.extensions.rollout import EngineContext, LogprobsMode, RolloutEngine
from rlhf_ops.padding import build_full_sequence
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams

__all__ = [
    "EngineContext",
    "LogprobsMode",
    "RolloutEngine",
    "SamplingParams",
    "build_rollout_output",
    "prompt_tensors",
]


def build_rollout_output(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    responses: Tensor,
    response_mask: Tensor,
    log_probs: Tensor,
    columns: Mapping[str, np.ndarray],
    n: int,
    pixel_values: Tensor | None = None,
    response_attention_mask: Tensor | None = None,
    row_columns: Mapping[str, Tensor] | None = None,
) -> DataProto:
    """The output every engine returns (keys in the module docstring), from rows already repeated n times.

    Args:
        prompt_ids: (B*n, P) left-padded prompts; prompt_mask: (B*n, P).
        responses: (B*n, R) right-padded; response_mask: (B*n, R) 1 up to and including the first EOS.
        log_probs: (B*n, R) float32 of the sampled tokens (masked to 0 here).
        columns: the request's non-tensor columns, B rows each (repeated n times here, like the tensors).
        n: samples per prompt.
        pixel_values: (B*n, k, C, H, W) images of a vision-language batch, else None.
        response_attention_mask: (B*n, R) 1 on every response token the model attends to; None means
            ``response_mask``. A multi-turn response attends to its tool output, which ``response_mask`` leaves out.
        row_columns: further (B*n,) tensors added as they are (the agent loop's per-row counters).
    """
    attended = response_mask if response_attention_mask is None else response_attention_mask
    full = build_full_sequence(prompt_ids, prompt_mask=prompt_mask, responses=responses, response_mask=attended)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs * response_mask,
        **full,
    }
    if pixel_values is not None:
        tensors["pixel_values"] = pixel_values
    tensors.update(row_columns or {})
    repeated = {k: np.repeat(v, n, axis=0) for k, v in columns.items()}
    return DataProto.from_dict(tensors, non_tensors=repeated)


def prompt_tensors(prompts: DataProto) -> tuple[Tensor, Tensor, Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` (B, P) of a request, checked (engines' shared input)."""
    if prompts.batch is None:
        raise ValueError("generate_sequences needs tensors input_ids, attention_mask, position_ids; got none.")
    found = []
    for key in ("input_ids", "attention_mask", "position_ids"):
        if key not in prompts.batch.keys():
            raise ValueError(f"generate_sequences needs tensor {key!r} (B, P); add it to the batch.")
        found.append(prompts.batch[key])
    if any(t.dim() != 2 or t.shape != found[0].shape for t in found):
        shapes = [tuple(t.shape) for t in found]
        raise ValueError(f"input_ids, attention_mask, position_ids must all be (B, P); got {shapes}.")
    return found[0], found[1], found[2]
