"""A few-layer copy of the real model (SmolLM2-135M-Instruct), bf16 on disk like the original, for fast tests.

The first ``layers`` decoder blocks keep their pretrained weights (embeddings, final norm and tied head too),
so activations and gradients have the real model's scales; only depth is cut.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

from tests.support.real_model import smollm2_path


@functools.cache
def shrunk_smollm2(out_dir: str, layers: int = 2) -> str:
    """Writes (once per ``out_dir``) and returns an HF directory of SmolLM2 cut to ``layers`` blocks."""
    import torch
    from transformers import AutoModelForCausalLM

    src = Path(smollm2_path())
    out = Path(out_dir)
    if not (out / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(src, num_hidden_layers=layers, dtype=torch.bfloat16)
        model.save_pretrained(out)
        for name in src.iterdir():  # tokenizer, chat template, generation config
            if name.is_file() and not name.name.endswith(".safetensors") and name.name != "config.json":
                shutil.copy(name, out / name.name)
    return str(out)
