"""A tiny LLaVA-style vision-language model and its processor, built locally and deterministically.

The VLM twin of :mod:`rlhf_ops.models.tiny`: a random-init ``LlavaForConditionalGeneration`` (a CLIP
vision tower, a two-layer MLP projector, the tiny Llama as language model) plus a ``LlavaProcessor``
(a PIL-backed CLIP image processor, the char-level tokenizer with an ``<image>`` token, a chat template
that keeps ``<image>`` placeholders), written with no hub access. Load it with
``AutoModelForImageTextToText.from_pretrained(d)`` and ``AutoProcessor.from_pretrained(d)``.

Why LLaVA and not Qwen2-VL: LLaVA's text positions are plain 1-D positions and its image features are
scattered, in order, into the ``<image>`` token positions of ``input_ids``. So left padding, the packed
(remove-padding) forward and the HF decode loop work unchanged and exactly (tested), and ``pixel_values``
is one (3, H, W) tensor per image, which splits by rows like every other batch tensor. Qwen2-VL needs 3-D
M-RoPE positions computed from the image grid and a flattened patch tensor per batch.

Sizes: 16 x 16 RGB images, 8 x 8 patches: 4 patches + CLS; the CLS output is dropped (LLaVA's ``default``
feature strategy), so each ``<image>`` placeholder expands to ``IMAGE_TOKENS_PER_IMAGE`` = 4 tokens. The
vision tower has width 32 (1 head of 32: vLLM's CPU attention needs head_dim >= 32) and 2 layers.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from rlhf_ops.models.tiny import (
    ALPHABET,
    TINY_MODEL_DEFAULTS,
    _check_reusable,
    _portable_tokenizer_class,
    build_tiny_tokenizer,
    make_tiny_config,
)

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 16
PATCH_SIZE = 8
IMAGE_TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLS dropped by the "default" feature strategy

# The tiny chat template, also for HF-style content lists: an image part renders as the placeholder the
# processor expands, a text part as its text; string contents (verl's "<image>..." rows) pass unchanged.
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
}
_BUILD_FILE = "tiny_build.json"
_BUILD_FORMAT = 2


def build_tiny_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The char-level tokenizer plus the ``<image>`` special token (id 84) and :data:`VLM_CHAT_TEMPLATE`."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vlm_processor(tokenizer: PreTrainedTokenizerFast | None = None) -> LlavaProcessor:
    """A ``LlavaProcessor``: PIL CLIP image processor (resize to 16 x 16, CLIP mean/std) + the tokenizer."""
    # The PIL backend: the torchvision ("fast") one is not installed (torchvision breaks the CPU stack).
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = tokenizer or build_tiny_vlm_tokenizer()
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, dropped again by the "default" strategy
        chat_template=VLM_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def make_tiny_vlm_config(tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    """The ``LlavaConfig``: tiny Llama text config, tiny CLIP vision config, ``image_token_id`` of ``<image>``."""
    text = make_tiny_config(tokenizer, **TINY_MODEL_DEFAULTS)
    vision = CLIPVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32, **_VISION_DEFAULTS)
    options: dict[str, Any] = {  # a dict: transformers' stubs lag its kwargs (image_token_id)
        "vision_config": vision,
        "text_config": text,
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "image_seq_length": IMAGE_TOKENS_PER_IMAGE,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
        "tie_word_embeddings": False,
    }
    config = LlavaConfig(**options)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    return config


def build_tiny_vlm_dir(out_dir: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Writes a random-init tiny ``LlavaForConditionalGeneration`` and its processor to ``out_dir``.

    Same guarantees as :func:`rlhf_ops.models.tiny.build_tiny_model_dir`: weights depend only on ``seed``
    (a forked RNG), the directory appears atomically, and a directory of the same build is reused.

    Returns:
        The directory path.

    Raises:
        ValueError: if ``out_dir`` exists with other contents or another build's arguments.
    """
    out = Path(out_dir)
    spec: dict[str, Any] = {
        "format": _BUILD_FORMAT,
        "kind": "llava",
        "seed": seed,
        "alphabet": ALPHABET,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        **TINY_MODEL_DEFAULTS,
        **{f"vision_{k}": v for k, v in _VISION_DEFAULTS.items()},
    }
    if _check_reusable(out, spec):
        return out
    tokenizer = build_tiny_vlm_tokenizer()
    config = make_tiny_vlm_config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        build_tiny_vlm_processor(tokenizer).save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
        (tmp / _BUILD_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True))
        if out.exists():  # an empty directory left by the caller
            out.rmdir()
        os.rename(tmp, out)
    except OSError:
        if not _check_reusable(out, spec):  # another process renamed the same build into place first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
