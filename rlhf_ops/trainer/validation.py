"""Validation: generate on the validation set with the validation sampling parameters, score it,
report reward (and accuracy where the reward function returns ``acc``) per data source."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlhf_ops.config.schema import SamplingConfig
from rlhf_ops.data.dataset import PromptLoader
from rlhf_ops.protocol import DataProto
from rlhf_ops.sampling import SamplingParams
from rlhf_ops.trainer.generation import merge_generation
from rlhf_ops.trainer.metrics import compute_reward_metrics_by_source
from rlhf_ops.trainer.reward import RewardStage, decode_responses
from rlhf_ops.trainer.roles import ActorRolloutRef, Tokenizer

_KEYS = ["prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"]


def generate_and_score(
    actor_rollout_ref: ActorRolloutRef,
    loader: PromptLoader,
    *,
    reward: RewardStage,
    sampling: SamplingConfig,
    response_length: int,
    tokenizer: Tokenizer,
    eos_token_ids: Sequence[int] | None = None,
    step: int | None = None,
) -> tuple[DataProto, dict[str, list[float]], list[str]]:
    """Every validation prompt, ``sampling.n`` times; returns the scored batch, reward extras and texts."""
    params = SamplingParams(
        temperature=max(sampling.temperature, 1e-6) if sampling.do_sample else 1.0,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        do_sample=sampling.do_sample,
        response_length=response_length,
        eos_token_id=tuple(eos_token_ids) if eos_token_ids else int(tokenizer.eos_token_id),
        pad_token_id=int(tokenizer.pad_token_id),
    )
    parts: list[DataProto] = []
    extras: dict[str, list[float]] = {}
    texts: list[str] = []
    for prompts in loader.iter_epoch():
        repeated = prompts.repeat(sampling.n, interleave=True)
        # No step: validation draws from the engines' running generators (it does not touch the training seeds);
        # a deterministic run seeds it apart from the training steps (rlhf_ops.trainer.determinism).
        generated = actor_rollout_ref.generate_sequences(repeated, params, step=step)
        batch = merge_generation(repeated, generated, keys=_KEYS)
        scores, extra = reward.score(batch)
        batch = batch.union(DataProto.from_dict(scores))
        for key, values in extra.items():
            extras.setdefault(key, []).extend(values)
        texts.extend(decode_responses(batch, tokenizer))
        parts.append(batch)
    return DataProto.concat(parts), extras, texts


def validate(
    actor_rollout_ref: ActorRolloutRef,
    loader: PromptLoader,
    *,
    reward: RewardStage,
    sampling: SamplingConfig,
    response_length: int,
    tokenizer: Tokenizer,
    eos_token_ids: Sequence[int] | None = None,
    step: int | None = None,
) -> dict[str, float]:
    """``val/<source>/reward/mean`` (+ extras such as ``acc``), ``val/response_length/mean``; ``step`` seeds
    the engines (None: their running generators)."""
    batch, extras, _ = generate_and_score(
        actor_rollout_ref,
        loader,
        reward=reward,
        sampling=sampling,
        response_length=response_length,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        step=step,
    )
    scores = batch.tensors["token_level_scores"].sum(-1)
    sources = list(batch.non_tensor_batch["data_source"])
    metrics = compute_reward_metrics_by_source(scores, sources, prefix="val", extra=extras)
    metrics["val/reward/mean"] = scores.mean().item()
    metrics["val/response_length/mean"] = batch.tensors["response_mask"].sum(-1).float().mean().item()
    if sampling.n > 1:
        metrics.update(_pass_at_k(scores, sources, n=sampling.n))
    return metrics


def _pass_at_k(scores: torch.Tensor, sources: list[str], *, n: int) -> dict[str, float]:
    """pass@n per source: a prompt passes when any of its n samples scores >= 1 (exact answer)."""
    solved = (scores.view(-1, n) >= 1.0).any(-1).float()
    per_prompt_sources = np.asarray(sources, dtype=object)[::n]
    out = {}
    for source in sorted(set(per_prompt_sources.tolist())):
        mask = torch.as_tensor(per_prompt_sources == source)
        out[f"val/{source}/pass@{n}"] = solved[mask].mean().item()
    return out
