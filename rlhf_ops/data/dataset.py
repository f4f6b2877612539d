"""Prompt datasets for training and validation, and a resumable loader of :class:`DataProto` batches.

Notation: B = prompts in a batch, P = ``max_prompt_length`` of the batch (left padding), k = images per
prompt, C x H x W = one processed image.

Sources are the files ``rlhf prepare-data`` writes (Parquet or JSONL, any fsspec URL), an HF
``datasets`` folder, or ``builtin:<toy task>``. Prompts longer than ``max_prompt_length`` tokens are
dropped here only as a safety net: data prep already routed them to ``rejected.jsonl``.

Vision-language data: rows with an ``images`` column are encoded by the model's processor
(:func:`rlhf_ops.data.images.encode_multimodal_prompt`), and batches carry ``pixel_values`` (B, k, C, H, W).
Every row of such a dataset must hold the same number k >= 1 of images (one tensor per batch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhf_ops.padding import compute_position_ids, pad_sequences_left
from rlhf_ops.protocol import DataProto

BUILTIN_PREFIX = "builtin:"


def read_rows(url: str, *, toy_rows: int = 512, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of one data source: ``builtin:<task>``, ``*.parquet``, ``*.jsonl`` or an HF datasets folder."""
    if url.startswith(BUILTIN_PREFIX):
        from rlhf_ops.data.toy_tasks import make_toy_dataset

        return make_toy_dataset(url.removeprefix(BUILTIN_PREFIX), num_rows=toy_rows, seed=seed)
    import fsspec

    if url.endswith(".parquet"):
        import pandas as pd

        with fsspec.open(url, "rb") as f:
            frame = pd.read_parquet(f)
        return [{str(k): _plain(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]
    if url.endswith((".jsonl", ".json")):
        with fsspec.open(url, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    from datasets import load_from_disk

    return [dict(r) for r in load_from_disk(url)]


def _plain(value: Any) -> Any:
    """Parquet returns numpy arrays for list columns (chat messages); turn them back into lists."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def row_ground_truth(row: dict[str, Any], key: str) -> str:
    """``row[key]``, else verl's nested ``row["reward_model"]["ground_truth"]``, else ``""``."""
    if key in row:
        return str(row[key])
    nested = row.get("reward_model")
    return str(nested["ground_truth"]) if isinstance(nested, dict) and "ground_truth" in nested else ""


def row_extra_info(row: dict[str, Any]) -> dict[str, Any]:
    """The row's ``extra_info`` as a dict: verl stores a struct, prepared files a JSON string; ``{}`` if absent."""
    value = row.get("extra_info")
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    return dict(value) if isinstance(value, dict) else {}


def encode_prompt(
    prompt: str | Sequence[dict[str, str]],
    tokenizer: Any,
    *,
    apply_chat_template: bool,
    tools: Sequence[dict[str, Any]] = (),
    tool_examples: Sequence[Any] = (),
) -> list[int]:
    """Token ids of one prompt; chat messages go through the tokenizer's chat template when it has one.

    ``tools`` (function schemas, multi-turn rollouts) are described to the model through the template, after
    ``tool_examples`` (:class:`rlhf_ops.agent.tools.ToolExample`: worked calls as chat turns before the question;
    :func:`rlhf_ops.agent.chat_format.encode_chat_prompt`).
    """
    if not isinstance(prompt, str):
        if tools and apply_chat_template and getattr(tokenizer, "chat_template", None):
            from rlhf_ops.agent.chat_format import encode_chat_prompt

            return encode_chat_prompt(tokenizer, list(prompt), tools, tool_examples)
        if apply_chat_template and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        prompt = "\n".join(m["content"] for m in prompt)
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


@dataclass
class PromptDataset:
    """Tokenised prompts with their reward-side columns, all of length N."""

    prompt_ids: list[list[int]]
    raw_prompts: list[Any]
    ground_truths: list[str]
    data_sources: list[str]
    num_dropped: int = 0
    extra_infos: list[dict[str, Any]] = field(default_factory=list)  # per row; empty: none
    pixel_values: list[torch.Tensor] | None = None
    """Per prompt (k, C, H, W) for image data, else None."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @classmethod
    def from_sources(
        cls,
        urls: Sequence[str],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        ground_truth_key: str = "ground_truth",
        data_source_key: str = "data_source",
        apply_chat_template: bool = True,
        toy_rows: int = 512,
        seed: int = 0,
        processor: Any | None = None,
        tools: Sequence[dict[str, Any]] = (),
        tool_examples: Sequence[Any] = (),
    ) -> PromptDataset:
        """Reads and tokenises ``urls``; ``processor`` (a multimodal processor) encodes rows with ``images``;
        ``tools`` (function schemas) are described in chat prompts, after ``tool_examples`` (worked calls)."""
        ids, raws, truths, sources, infos, dropped = [], [], [], [], [], 0
        pixels: list[torch.Tensor] = []
        for i, url in enumerate(urls):
            for row in read_rows(url, toy_rows=toy_rows, seed=seed + i):
                if prompt_key not in row:
                    raise ValueError(f"data: a row of {url} has no column {prompt_key!r}; set data.prompt_key")
                if row.get("images") is not None and len(row["images"]) > 0:
                    from rlhf_ops.data.images import encode_multimodal_prompt

                    tokens, pixel_values = encode_multimodal_prompt(
                        row[prompt_key], row["images"], processor, apply_chat_template=apply_chat_template
                    )
                else:
                    tokens = encode_prompt(
                        row[prompt_key],
                        tokenizer,
                        apply_chat_template=apply_chat_template,
                        tools=tools,
                        tool_examples=tool_examples,
                    )
                    pixel_values = torch.zeros(0)
                if len(tokens) > max_prompt_length:
                    dropped += 1
                    continue
                pixels.append(pixel_values)
                ids.append(tokens)
                raws.append(row[prompt_key])
                truths.append(row_ground_truth(row, ground_truth_key))
                sources.append(str(row.get(data_source_key, url)))
                infos.append(row_extra_info(row))
        if not ids:
            raise ValueError(
                f"data: no usable prompt in {list(urls)} ({dropped} over data.max_prompt_length="
                f"{max_prompt_length}); raise data.max_prompt_length or fix the files"
            )
        shapes = {tuple(p.shape) for p in pixels}
        if shapes == {(0,)}:
            return cls(ids, raws, truths, sources, dropped, infos)
        if len(shapes) != 1:
            raise ValueError(
                f"data: image rows must all hold the same number and size of images (found pixel_values shapes "
                f"{sorted(shapes)[:4]}); a batch is one (B, k, C, H, W) tensor: fix the files' images columns"
            )
        return cls(ids, raws, truths, sources, dropped, infos, pixel_values=pixels)

    def batch(self, indices: Sequence[int], *, pad_token_id: int, uid_prefix: str) -> DataProto:
        """The prompts at ``indices`` as a left-padded batch ``input_ids`` (B, P) with masks and uids."""
        seqs = [self.prompt_ids[i] for i in indices]
        extra = {}
        if self.extra_infos:  # an object array of dicts, filled in place so numpy never iterates a dict
            extra["extra_info"] = np.empty(len(indices), dtype=object)
            extra["extra_info"][:] = [self.extra_infos[i] for i in indices]
        input_ids = pad_sequences_left(seqs, pad_value=pad_token_id)
        attention_mask = pad_sequences_left([[1] * len(s) for s in seqs], pad_value=0)
        tensors = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask),
        }
        if self.pixel_values is not None:
            tensors["pixel_values"] = torch.stack([self.pixel_values[i] for i in indices])  # (B, k, C, H, W)
        return DataProto.from_dict(
            tensors=tensors,
            non_tensors={
                "uid": np.array([f"{uid_prefix}-{i}" for i in indices], dtype=object),
                "raw_prompt": np.array([self.raw_prompts[i] for i in indices] + [None], dtype=object)[:-1],
                "ground_truth": np.array([self.ground_truths[i] for i in indices], dtype=object),
                "data_source": np.array([self.data_sources[i] for i in indices], dtype=object),
                **extra,
            },
        )


class PromptLoader:
    """Epochs of shuffled, fixed-size batches with a resumable position.

    The order of epoch ``e`` is ``randperm(N)`` under seed ``seed + e``, so a loader restored from
    :meth:`state_dict` yields exactly the batches an uninterrupted one would have yielded next.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        *,
        batch_size: int,
        pad_token_id: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size > len(dataset) and drop_last:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts); "
                "lower it or add data"
            )
        self.dataset, self.batch_size, self.pad_token_id = dataset, batch_size, pad_token_id
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.position = 0, 0  # position: batches already taken in this epoch

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def next_batch(self) -> DataProto:
        """The next batch, moving into the next epoch when this one is exhausted."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        start = self.position * self.batch_size
        indices = order[start : start + self.batch_size]
        self.position += 1
        return self.dataset.batch(indices, pad_token_id=self.pad_token_id, uid_prefix=f"e{self.epoch}")

    def iter_epoch(self) -> Iterator[DataProto]:
        """All batches of one pass in order (validation)."""
        for start in range(0, len(self.dataset), self.batch_size):
            indices = list(range(start, min(start + self.batch_size, len(self.dataset))))
            yield self.dataset.batch(indices, pad_token_id=self.pad_token_id, uid_prefix="val")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
