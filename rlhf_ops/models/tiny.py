"""A tiny Llama-style causal LM and char-level tokenizer, built locally and deterministically.

Tests, demos and the learning test need a real HF model directory without the model hub. This module
writes one: ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) and a ``tiny_build.json`` that
records the build arguments so a second call with the same arguments reuses the directory.

Loading:
    policy / reference: ``AutoModelForCausalLM.from_pretrained(d)``; tokenizer: ``AutoTokenizer.from_pretrained(d)``.
    critic (value head per token): ``AutoModelForTokenClassification.from_pretrained(d, num_labels=1,
    classifier_dropout=0.0)``; the ``score`` head is freshly initialised (a "newly initialized" warning
    is expected). ``classifier_dropout=0.0`` matters: the generic head defaults to dropout 0.1.
    reward model (tests only): ``tests.support.builders.build_tiny_reward_model_dir``.

The tokenizer is char-level (one token per character of a fixed alphabet) over a ``WordLevel`` model,
so the vocabulary is small (84 ids) and a random policy puts ~12% of its mass on digits, which the toy
tasks reward. Characters outside the alphabet encode to ``<unk>``.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)
# One token per character; ids follow this order after the special tokens (pad=0, bos=1, eos=2, unk=3).
ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n:+-*=>?.,!'()"

# `<|role|>content\n` per message, a leading <bos>, and `<|assistant|>` as the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

TINY_MODEL_DEFAULTS: Mapping[str, int] = MappingProxyType(
    {
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 2,  # head_dim = 64 / 2 = 32: vLLM's CPU attention needs head_dim >= 32
        "num_kv_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
    }
)
_BUILD_FILE = "tiny_build.json"
_BUILD_FORMAT = 1


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Returns the char-level tokenizer: left padding, pad/bos/eos/unk set, chat template attached."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split before every character ("" pattern, isolated) so each character is its own word; Fuse
    # concatenates tokens on decode (WordLevel's default decoder would insert spaces).
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=TINY_MODEL_DEFAULTS["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> LlamaConfig:
    """Returns the ``LlamaConfig`` of the tiny model for ``tokenizer`` (vocab size and special ids).

    Raises:
        ValueError: if ``hidden_size`` is not a multiple of ``num_heads``, the head dim is below 32, or
            ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads}; change either.")
    if hidden_size // num_heads < 32:
        raise ValueError(
            f"head_dim = hidden_size / num_heads = {hidden_size // num_heads} < 32 (vLLM CPU attention needs "
            f">= 32); raise hidden_size or lower num_heads."
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}.")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )


def build_tiny_model_dir(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = TINY_MODEL_DEFAULTS["hidden_size"],
    num_layers: int = TINY_MODEL_DEFAULTS["num_layers"],
    num_heads: int = TINY_MODEL_DEFAULTS["num_heads"],
    num_kv_heads: int = TINY_MODEL_DEFAULTS["num_kv_heads"],
    intermediate_size: int = TINY_MODEL_DEFAULTS["intermediate_size"],
    max_position_embeddings: int = TINY_MODEL_DEFAULTS["max_position_embeddings"],
) -> Path:
    """Writes a randomly initialised tiny ``LlamaForCausalLM`` and its tokenizer to ``out_dir``.

    The weights depend only on the arguments (``seed`` seeds a forked RNG; the caller's RNG state is
    untouched). Idempotent and safe under concurrent callers: the directory is written to a temporary
    sibling and renamed into place; an existing directory built with the same arguments is reused.

    Args:
        out_dir: Target directory (created with its parents).
        seed: Seed of the weight initialisation.
        hidden_size: Model width; ``hidden_size / num_heads`` must be >= 32.
        num_layers: Number of decoder blocks.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads (GQA when below ``num_heads``).
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence (prompt + response).

    Returns:
        The directory path.

    Raises:
        ValueError: if ``out_dir`` exists with other contents or another build's arguments.
    """
    sizes = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    return _build_dir(Path(out_dir), _spec("causal_lm", seed, sizes))


def _spec(kind: str, seed: int, sizes: Mapping[str, int]) -> dict[str, Any]:
    """The build record: equal records mean byte-identical directories (the alphabet fixes the tokenizer)."""
    return {"format": _BUILD_FORMAT, "kind": kind, "seed": seed, "alphabet": ALPHABET, **sizes}


def _read_spec(out_dir: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((out_dir / _BUILD_FILE).read_text()))
    except (OSError, ValueError):
        return None


def _check_reusable(out_dir: Path, spec: dict[str, Any]) -> bool:
    """True if ``out_dir`` holds this exact build; False if it does not exist or is empty."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return False
    found = _read_spec(out_dir)
    if found != spec:
        raise ValueError(
            f"out_dir={str(out_dir)!r} already exists and was not built with these arguments "
            f"(found build spec {found}, wanted {spec}); pass another out_dir or delete that directory."
        )
    return True


def _portable_tokenizer_class(model_dir: Path) -> None:
    """Names the tokenizer class ``PreTrainedTokenizerFast`` (transformers 5 writes ``TokenizersBackend``).

    transformers 5 maps ``PreTrainedTokenizerFast`` to its ``TokenizersBackend``; transformers 4.x (and
    tools pinned to it) does not know ``TokenizersBackend``. The old name loads the same tokenizer in both.
    """
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _build_dir(out_dir: Path, spec: dict[str, Any]) -> Path:
    if _check_reusable(out_dir, spec):
        return out_dir
    tokenizer = build_tiny_tokenizer()
    sizes = {k: spec[k] for k in TINY_MODEL_DEFAULTS}
    config = make_tiny_config(tokenizer, **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
        (tmp / _BUILD_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True))
        if out_dir.exists():  # an empty directory left by the caller: rename cannot replace it otherwise
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except OSError:
        # Another process renamed its build into place first: reuse it if it is the same build.
        if not _check_reusable(out_dir, spec):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
