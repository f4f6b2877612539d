"""Generation for evaluation: a rollout engine on an HF model folder, in this one process (no Ray).

The engine is injected (:mod:`rlhf_ops.evaluation.engines`): the caller passes the factory that builds
it on the loaded model (the training's ``HFRollout``), so the library imports nothing from ``workers/``.

Notation: B = prompts in a batch, n = samples per prompt, R = ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_ops.data.dataset import PromptDataset
from rlhf_ops.evaluation.engines import EngineFactory
from rlhf_ops.sampling import SamplingParams


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One decoded response of prompt ``prompt_index`` (its ``sample`` number among the n)."""

    prompt_index: int
    sample: int
    text: str
    length: int


def load_policy(model_dir: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an HF folder, the model in eval mode on the CPU or the first GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    model = model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def generate(
    engine_factory: EngineFactory,
    model: Any,
    tokenizer: Any,
    dataset: PromptDataset,
    indices: Sequence[int],
    *,
    n: int,
    do_sample: bool,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    batch_size: int = 64,
    seed: int = 0,
) -> list[Generation]:
    """``n`` responses to each prompt at ``indices`` (greedy when ``do_sample`` is False).

    ``engine_factory`` builds the rollout engine on ``model`` with these sampling settings (``HFRollout``).

    Returns:
        ``len(indices) * n`` generations, prompt-major (the n samples of a prompt are adjacent).
    """
    device = next(model.parameters()).device
    engine = engine_factory(
        model,
        pad_token_id=int(tokenizer.pad_token_id),
        eos_token_id=int(tokenizer.eos_token_id),
        response_length=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        do_sample=do_sample,
        seed=seed,
        sync_stop=False,
    )
    sampling = SamplingParams(  # the engine's settings, n samples per prompt
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        do_sample=do_sample,
        response_length=max_new_tokens,
        eos_token_id=int(tokenizer.eos_token_id),
        pad_token_id=int(tokenizer.pad_token_id),
    )
    out: list[Generation] = []
    for start in range(0, len(indices), batch_size):
        chunk = list(indices[start : start + batch_size])
        batch = dataset.batch(chunk, pad_token_id=int(tokenizer.pad_token_id), uid_prefix="eval").to(device)
        result = engine.generate_sequences(batch, sampling)
        assert result.batch is not None  # the engine always returns tensors
        responses, mask = result.batch["responses"], result.batch["response_mask"]  # (B*n, R) each
        lengths = mask.sum(-1).tolist()
        for row, (tokens, length) in enumerate(zip(responses, lengths, strict=True)):
            text = tokenizer.decode(tokens[: int(length)].tolist(), skip_special_tokens=True)
            out.append(Generation(prompt_index=chunk[row // n], sample=row % n, text=text, length=int(length)))
    return out


def generate_vllm(
    model_dir: str,
    tokenizer: Any,
    dataset: PromptDataset,
    indices: Sequence[int],
    *,
    n: int,
    do_sample: bool,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int = 0,
    dtype: str = "float32",
    kv_cache_memory_bytes: int = 1024 * 1024 * 1024,
) -> list[Generation]:
    """As :func:`generate`, with an in-process vLLM engine (continuous batching: much faster on many prompts).

    The engine stops on every EOS id of the model's ``generation_config.json`` and the tokenizer's EOS;
    token ids go in and out (the prompts are the dataset's own encodings, chat template included).
    """
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, TokensPrompt
    from vllm import SamplingParams as VllmSamplingParams

    from rlhf_ops.models.generation import eos_token_ids

    eos = eos_token_ids(model_dir, tokenizer)
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "enforce_eager": True,
        "seed": seed,
        "generation_config": "vllm",
        "skip_tokenizer_init": True,
        "disable_log_stats": True,
    }
    if not torch.cuda.is_available():
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    llm = LLM(model_dir, **kwargs)
    params = VllmSamplingParams(
        n=n,
        temperature=temperature if do_sample else 0.0,
        top_p=top_p if do_sample else 1.0,
        top_k=top_k if do_sample else -1,
        max_tokens=max_new_tokens,
        stop_token_ids=eos,
        seed=seed,
        detokenize=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=dataset.prompt_ids[i]) for i in indices]
    results = llm.generate(prompts, params, use_tqdm=False)
    out: list[Generation] = []
    for prompt_index, result in zip(indices, results, strict=True):
        for sample, completion in enumerate(result.outputs):
            tokens = list(completion.token_ids)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(Generation(prompt_index=prompt_index, sample=sample, text=text, length=len(tokens)))
    return out
