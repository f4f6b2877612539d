"""Images in prompt data: validation for ``prepare-data``, processor encoding for training, the colour toy task.

Notation: k = images per prompt, C = 3 channels, H x W = the processor's image size.

Row format (verl's multimodal layout): an ``images`` column holding a list of images, and one ``<image>``
placeholder per image in the prompt text, where the image goes. An image in a source row may be raw
bytes (PNG, JPEG, ... anything PIL decodes), ``{"bytes": ..., "path": ...}`` (the HF ``datasets``
``Image`` feature and verl's parquet), a ``data:image/...;base64,`` URL (JSON-friendly) or a local file
path. ``prepare-data`` decodes each one fully, rejects the row on failure (kind ``bad_image``, one line),
and stores the original encoded bytes in the parquet (``images``: ``list<binary>``).

Training encodes a prompt with the model's processor (:func:`encode_multimodal_prompt`): the chat
template keeps the placeholders, the processor expands each into the model's image tokens and returns
``pixel_values`` (k, C, H, W). The token count ``prepare-data`` checks against ``max_prompt_length`` comes
from the same function, so the trainer never drops an accepted row.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

IMAGE_PLACEHOLDER = "<image>"
COLOR_NAME_SOURCE = "toy/color_name"
# Words with distinct first letters, all in the tiny tokenizer's alphabet; RGB of the solid image.
TOY_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 220, 40),
}
_TOY_IMAGE_SIZE = 16


class ImageError(ValueError):
    """An image of a row cannot be read or decoded; the message is one line naming the image."""


def image_bytes(value: Any, *, index: int) -> bytes:
    """The encoded bytes of one source image (see the module docstring for the accepted forms).

    Raises:
        ImageError: an unsupported value, an unreadable path or base64 payload.
    """
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            value = data
        elif path:
            value = str(path)
        else:
            raise ImageError(f"images[{index}] is a dict without 'bytes' or 'path'")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        if value.startswith("data:"):
            _, _, payload = value.partition(",")
            try:
                return base64.b64decode(payload, validate=True)
            except ValueError as exc:
                raise ImageError(f"images[{index}] is a data: URL whose base64 payload is invalid ({exc})") from None
        try:
            return Path(value).read_bytes()
        except OSError as exc:
            raise ImageError(f"images[{index}]: cannot read image file {value!r} ({exc.strerror})") from None
    raise ImageError(f"images[{index}] is {type(value).__name__}; expected bytes, {{'bytes', 'path'}}, or a path")


def decode_image(data: bytes, *, index: int = 0) -> Any:
    """Fully decodes ``data`` to an RGB ``PIL.Image`` (a truncated file fails here, not in training).

    Raises:
        ImageError: PIL cannot identify or decode the bytes.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode every pixel: open() alone only reads the header
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageError(f"images[{index}] ({len(data)} bytes) cannot be decoded as an image: {reason}") from None


def validate_images(value: Any, *, prompt_text: str) -> list[bytes]:
    """The row's images as encoded bytes, each checked to decode; placeholders must match the image count.

    Args:
        value: The row's ``images`` value: a list (or one image); None means no images.
        prompt_text: The prompt's text (all message contents joined), where ``<image>`` placeholders are.

    Raises:
        ImageError: an image does not decode, or the placeholder count differs from the image count.
    """
    items = [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
    images = [image_bytes(item, index=i) for i, item in enumerate(items)]
    for i, data in enumerate(images):
        decode_image(data, index=i)
    placeholders = prompt_text.count(IMAGE_PLACEHOLDER)
    if placeholders != len(images):
        raise ImageError(
            f"prompt has {placeholders} {IMAGE_PLACEHOLDER!r} placeholder(s) but the row has {len(images)} "
            f"image(s); put one {IMAGE_PLACEHOLDER!r} in the prompt text per image"
        )
    return images


def is_processor(obj: Any) -> bool:
    """Whether ``obj`` is a multimodal processor (has an image processor), not a plain tokenizer."""
    return getattr(obj, "image_processor", None) is not None


def load_tokenizer_or_processor(path: str, *, trust_remote_code: bool = False) -> Any:
    """The directory's processor when it has an image processor config, else its tokenizer."""
    from transformers import AutoProcessor, AutoTokenizer

    if any((Path(path) / name).exists() for name in ("processor_config.json", "preprocessor_config.json")):
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        if is_processor(processor):
            return processor
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def encode_multimodal_prompt(
    prompt: str | Sequence[dict[str, Any]], images: Sequence[bytes], processor: Any, *, apply_chat_template: bool
) -> tuple[list[int], Tensor]:
    """Token ids (placeholders expanded to image tokens) and ``pixel_values`` (k, C, H, W) of one prompt.

    Raises:
        ImageError: an image does not decode.
        ValueError: ``processor`` has no image processor.
    """
    if not is_processor(processor):
        raise ValueError(
            "data: rows have images but the tokenizer is not a multimodal processor; use a vision-language "
            "model (model.path / --tokenizer, e.g. builtin:tiny-vlm) whose directory has a processor config"
        )
    if isinstance(prompt, str):
        text = prompt
    elif apply_chat_template and getattr(processor, "chat_template", None):
        text = processor.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(str(m["content"]) for m in prompt)
    pil = [decode_image(data, index=i) for i, data in enumerate(images)]
    encoded = processor(text=[text], images=pil or None, return_tensors="pt")
    ids = [int(i) for i in encoded["input_ids"][0]]
    pixel_values = encoded["pixel_values"].float() if pil else torch.zeros(0)
    return ids, pixel_values


def solid_png(rgb: tuple[int, int, int], *, size: int = _TOY_IMAGE_SIZE) -> bytes:
    """PNG bytes of a ``size`` x ``size`` image of one colour (deterministic: no timestamps in PNG)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def color_name_row(rng: random.Random) -> tuple[str, str, str, list[bytes]]:
    """One ``color_name`` row: (prompt text with a placeholder, colour word, data source, [PNG bytes])."""
    name = rng.choice(sorted(TOY_COLORS))
    return f"{IMAGE_PLACEHOLDER}colour?", name, COLOR_NAME_SOURCE, [solid_png(TOY_COLORS[name])]
