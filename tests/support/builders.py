"""Test inputs that only tests build: a tiny reward model folder and a toy dataset file.

The library builds what the platform itself serves (``builtin:tiny-llama``: ``rlhf_ops.models.tiny``; the
``builtin:<task>`` rows: ``rlhf_ops.data.toy_tasks.make_toy_dataset``); these write the rest to disk from the
same parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlhf_ops.data.toy_tasks import make_toy_dataset


def build_tiny_reward_model_dir(out_dir: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Writes a randomly initialised tiny ``LlamaForSequenceClassification`` (``num_labels=1``) to ``out_dir``.

    The tiny policy's architecture and tokenizer (``rlhf_ops.models.tiny``), weights drawn from ``seed`` (global
    RNGs untouched). Load with ``AutoModelForSequenceClassification.from_pretrained(d)``: its logits (B, 1) are the
    score of the last non-pad token of each row (``pad_token_id`` is set). Reuses ``out_dir`` if it has a model.
    """
    import torch
    from transformers import LlamaForSequenceClassification

    from rlhf_ops.models.tiny import TINY_MODEL_DEFAULTS, build_tiny_tokenizer, make_tiny_config

    path = Path(out_dir)
    if (path / "config.json").is_file():
        return path
    tokenizer = build_tiny_tokenizer()
    config = make_tiny_config(tokenizer, **TINY_MODEL_DEFAULTS)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def write_toy_dataset(
    name: str, out_path: str | os.PathLike[str], *, num_rows: int, seed: int, chat: bool = True
) -> Path:
    """Writes ``make_toy_dataset(name, ...)`` rows to ``out_path`` (``.jsonl`` or ``.parquet``, by suffix).

    Returns:
        The path written (parents are created).
    """
    path = Path(out_path)
    assert path.suffix in (".jsonl", ".parquet"), path
    rows = make_toy_dataset(name, num_rows=num_rows, seed=seed, chat=chat)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path, index=False)
    return path
