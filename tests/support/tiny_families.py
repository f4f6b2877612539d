"""Tiny random models of the architectures users bring (Qwen2, Qwen3, Mistral, Gemma 2, Phi-3), built locally.

Each is built from its transformers config class (no hub) with the built-in character tokenizer
(``rlhf_ops.models.tiny.build_tiny_tokenizer``: 84 ids, pad 0, bos 1, eos 2), 2 layers, head_dim 32 (vLLM's CPU
attention needs >= 32). What sets each family apart is switched on, so a path that drops it shows:

- qwen2: biases on the q/k/v projections;
- qwen3: RMSNorms on q and k per head (``q_norm`` / ``k_norm``), an explicit ``head_dim``;
- mistral: grouped-query attention (4 query / 2 kv heads) and a sliding window;
- gemma2: RMSNorm with the ``1 + w`` offset, attention and final logit soft-capping, the query scale
  ``query_pre_attn_scalar``, embeddings scaled by sqrt(hidden), tied head, pre/post feed-forward norms;
- phi3: fused ``qkv_proj`` and ``gate_up_proj`` (split by vLLM's loader, kept fused by transformers).

The random init leaves biases at 0 and norm weights at their constant; both are redrawn (N(0, 0.1) added) so
a weight sync or an export that missed one would change the logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2", "qwen3", "mistral", "gemma2", "phi3")
_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "dtype": "float32",
}


def _config(family: str, vocab_size: int, special: dict[str, int]) -> Any:
    """The family's transformers config with the tiny sizes."""
    import transformers

    common: dict[str, Any] = {**_COMMON, "vocab_size": vocab_size, **special}
    if family == "qwen2":  # q/k/v biases are built in
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if family == "mistral":
        common.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
        return transformers.MistralConfig(**common, sliding_window=256, tie_word_embeddings=False)
    if family == "gemma2":
        return transformers.Gemma2Config(
            **common,
            head_dim=32,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=256,
            tie_word_embeddings=True,
        )
    if family == "phi3":
        return transformers.Phi3Config(**common, tie_word_embeddings=False)
    raise ValueError(f"family={family!r}: use one of {', '.join(FAMILIES)}")


def build_tiny_family_dir(out_dir: str | Path, family: str, *, seed: int = 0) -> Path:
    """Writes a random tiny ``family`` causal LM and the character tokenizer to ``out_dir`` (reused if built).

    Returns:
        The directory: ``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rlhf_ops.models.tiny import build_tiny_tokenizer

    out = Path(out_dir)
    if (out / "model.safetensors").is_file():
        return out
    tokenizer = build_tiny_tokenizer()
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = _config(family, len(tokenizer), special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.add_(0.1 * torch.randn_like(param))
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tok_config = out / "tokenizer_config.json"  # portable name, as rlhf_ops.models.tiny writes it
    data = json.loads(tok_config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config.write_text(json.dumps(data, indent=2, sort_keys=True))
    return out
