"""The ids that end a response: the tokenizer's EOS plus every EOS id of the model's ``generation_config.json``.

Instruct models often stop on more than one token (Llama 3: ``<|end_of_text|>`` and ``<|eot_id|>``; Qwen2.5:
``<|im_end|>`` and ``<|endoftext|>``) and list them only in ``generation_config.json``; the tokenizer knows
one. Rollout engines stop on the whole list, and :func:`rlhf_ops.padding.get_response_mask` keeps the first
of them in the mask. The platform never lets vLLM read the generation config itself
(``generation_config="vllm"``): sampling comes from the run's config, the stop ids from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["eos_token_ids"]


def eos_token_ids(model_dir: str | os.PathLike[str] | None, tokenizer: Any) -> list[int]:
    """The tokenizer's ``eos_token_id`` first, then the other ids of ``generation_config.json``'s ``eos_token_id``.

    Args:
        model_dir: The local HF model directory (None, or a directory without ``generation_config.json``:
            the tokenizer's EOS only).
        tokenizer: An HF tokenizer with ``eos_token_id`` set.

    Returns:
        Distinct ids, the tokenizer's first (it is also the default pad id of many models).

    Raises:
        ValueError: if the tokenizer has no EOS and the generation config lists none, or the generation
            config is not valid JSON / its ``eos_token_id`` is not an int or a list of ints.
    """
    ids: list[int] = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if path is not None and path.is_file():
        try:
            listed = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"model.path: {path} is not a JSON object ({exc}); fix or delete the file") from exc
        values = [listed] if isinstance(listed, int) else listed
        if values is not None and not (isinstance(values, list) and all(isinstance(v, int) for v in values)):
            raise ValueError(f"model.path: {path} has eos_token_id={listed!r}; it must be an int or a list of ints")
        ids.extend(int(v) for v in values or [] if int(v) not in ids)
    if not ids:
        raise ValueError(
            f"model.path: neither the tokenizer nor {path or 'a generation_config.json'} defines an EOS token; set "
            "eos_token in the tokenizer config or eos_token_id in generation_config.json"
        )
    return ids
