"""Generation for evaluation: a rollout engine of the table, on an HF model folder, in this one process (no Ray).

Evaluation decodes through the same engines as training: the ``rollout.engine`` entry of
:data:`rlhf_ops.extensions.ROLLOUT_ENGINES` (built-in, entry point or dotted path), built from one
:class:`~rlhf_ops.extensions.rollout.EngineContext` and called through the one
:class:`~rlhf_ops.extensions.RolloutEngine` interface. An engine that decodes with the policy module (HF) gets
the loaded model; one that loads its own copy (vLLM, SGLang) gets the folder. The library names the engines'
code by string, so it imports nothing from ``workers/``.

Notation: B = prompts in a batch, n = samples per prompt, R = ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhf_ops.config.schema import RolloutConfig
from rlhf_ops.data.dataset import PromptDataset
from rlhf_ops.extensions.rollout import ROLLOUT_ENGINES, EngineContext, RolloutEngine
from rlhf_ops.sampling import SamplingParams

# The KV cache of an engine that holds its own copy on CPU (vLLM): 1 GiB, enough for the evaluation's batches.
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One decoded response of prompt ``prompt_index`` (its ``sample`` number among the n)."""

    prompt_index: int
    sample: int
    text: str
    length: int


def load_tokenizer(model_dir: str, *, trust_remote_code: bool = False) -> Any:
    """The folder's tokenizer, with the EOS as padding when it has no pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(model_dir: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> Any:
    """The folder's causal LM in eval mode on the CPU or the first GPU."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    model = model.to(device)
    model.eval()
    return model


def build_eval_engine(
    engine: str,
    model_dir: str,
    tokenizer: Any,
    *,
    max_prompt_length: int,
    max_new_tokens: int,
    seed: int,
    dtype: str = "float32",
) -> tuple[RolloutEngine, EngineContext]:
    """The engine ``engine`` selects (a ``rollout.engine`` value) on the model in ``model_dir``, built from one
    :class:`EngineContext` as training builds it; returns the engine and that context.

    The stop ids are training's (:func:`rlhf_ops.models.generation.eos_token_ids`: the tokenizer's EOS and those
    of ``generation_config.json``); the sampling settings come with each call.

    Raises:
        ValueError: ``engine`` is no engine of the table, or its package is not installed here (one line each).
    """
    from rlhf_ops.models.generation import eos_token_ids

    spec = ROLLOUT_ENGINES.get(engine, key="engine")
    missing = spec.missing_package()
    if missing:
        raise ValueError(f"engine={engine}: {missing}; evaluate with engine=hf")
    device: Literal["cpu", "cuda"] = "cuda" if torch.cuda.is_available() else "cpu"
    config = RolloutConfig.model_validate(
        {
            "engine": engine,
            "max_new_tokens": max_new_tokens,
            "dtype": dtype,
            "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES if device == "cpu" else None,
            "gpu_memory_utilization": 0.9,  # the engine has the device to itself
            "free_cache_engine": False,  # nothing trains between the calls
        }
    )
    context = EngineContext(
        model_path=model_dir,
        config=config,
        pad_token_id=int(tokenizer.pad_token_id),
        eos_token_id=tuple(eos_token_ids(model_dir, tokenizer)),
        seed=seed,
        device=device,
        max_prompt_length=max_prompt_length,
        logprobs_mode="raw",
        module=load_policy(model_dir, dtype=dtype) if spec.needs_module else None,
    )
    built: RolloutEngine = spec.load()(context)
    return built, context


def generate(
    engine: RolloutEngine,
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
    device: str | torch.device = "cpu",
    eos_token_id: int | Sequence[int] | None = None,
) -> list[Generation]:
    """``n`` responses to each prompt at ``indices`` (greedy when ``do_sample`` is False), ``batch_size`` prompts
    per call of ``engine.generate_sequences``.

    Args:
        eos_token_id: The ids that end a response (None: the tokenizer's EOS).
        device: Where the prompt tensors go (the module's device for an in-process engine).

    Returns:
        ``len(indices) * n`` generations, prompt-major (the n samples of a prompt are adjacent).
    """
    eos = int(tokenizer.eos_token_id) if eos_token_id is None else eos_token_id
    sampling = SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        do_sample=do_sample,
        response_length=max_new_tokens,
        eos_token_id=eos if isinstance(eos, int) else tuple(eos),
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
