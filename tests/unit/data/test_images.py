"""Images in prompt data: decoding and rejection, prepare-data's image column, the dataset's pixel_values.

Token counts by hand (tiny VLM processor: each ``<image>`` expands to (16 / 8)^2 = 4 image tokens, one token
per character otherwise; the chat template is ``<bos>`` + ``<|role|>content\\n`` + ``<|assistant|>``):
    chat [user "<image>colour?"]      -> 1 + (1 + 4 + 7 + 1) + 1 = 15 tokens
    chat [user "<image><image>same?"] -> 1 + (1 + 8 + 5 + 1) + 1 = 17 tokens
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_ops.data.dataset import PromptDataset
from rlhf_ops.data.images import (
    TOY_COLORS,
    ImageError,
    image_bytes,
    load_tokenizer_or_processor,
    solid_png,
    validate_images,
)
from rlhf_ops.data.prepare import PrepareSpec, prepare_dataset
from rlhf_ops.data.toy_tasks import make_toy_dataset
from rlhf_ops.rewards.toy import color_name_score

RED, BLUE = solid_png(TOY_COLORS["red"]), solid_png(TOY_COLORS["blue"])


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir: str) -> Any:
    return load_tokenizer_or_processor(tiny_vlm_dir)


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_image_forms_decode_to_the_same_bytes(tmp_path: Path) -> None:
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    forms = [RED, {"bytes": RED, "path": None}, {"bytes": None, "path": str(path)}, str(path), _data_url(RED)]
    assert [image_bytes(f, index=0) for f in forms] == [RED] * 5
    assert validate_images(forms, prompt_text="<image>" * 5) == [RED] * 5


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([RED[:40]], r"images\[0\] \(40 bytes\) cannot be decoded as an image"),  # truncated PNG
        ([RED, b"not an image"], r"images\[1\] \(12 bytes\) cannot be decoded as an image"),
        (["data:image/png;base64,***"], r"images\[0\] is a data: URL whose base64 payload is invalid"),
        (["/nonexistent/x.png"], r"images\[0\]: cannot read image file '/nonexistent/x.png'"),
        ([{"path": None}], r"images\[0\] is a dict without 'bytes' or 'path'"),
        ([3], r"images\[0\] is int; expected bytes"),
        ([RED, RED], r"prompt has 1 '<image>' placeholder\(s\) but the row has 2 image\(s\)"),
        (None, r"prompt has 1 '<image>' placeholder\(s\) but the row has 0 image\(s\)"),
    ],
)
def test_bad_images_are_one_line_errors(value: Any, match: str) -> None:
    with pytest.raises(ImageError, match=match) as info:
        validate_images(value, prompt_text="<image>colour?")
    assert "\n" not in str(info.value)


def test_prepare_stores_images_as_bytes_and_rejects_unreadable_ones(tmp_path: Path, processor: Any) -> None:
    rows = [
        {"prompt": "<image>colour?", "ground_truth": "red", "images": [_data_url(RED)]},
        {"prompt": "<image><image>same?", "ground_truth": "no", "images": [_data_url(RED), _data_url(BLUE)]},
        {"prompt": "<image>colour?", "ground_truth": "blue", "images": ["data:image/png;base64,aGVsbG8="]},  # "hello"
        {"prompt": "<image>colour?", "ground_truth": "blue"},  # no image for the placeholder
    ]
    source = tmp_path / "raw.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = PrepareSpec(
        source=str(source), prompt_format="chat", max_prompt_length=17, val_fraction=0.0, max_rejected_fraction=0.5
    )
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r1", tokenizer=processor)
    assert (result.num_train, result.num_rejected) == (2, 2)
    table = pq.read_table(result.train_url)
    field = table.schema.field("images").type
    assert isinstance(field, pa.ListType) and field.value_type == pa.binary()
    train = table.to_pylist()
    assert [r["images"] for r in train] == [[RED], [RED, BLUE]]  # the original encoded bytes
    assert [r["prompt_num_tokens"] for r in train] == [15, 17]  # image tokens counted (module docstring)
    reasons = [json.loads(line) for line in Path(result.rejected_url).read_text().splitlines()]
    assert [r["kind"] for r in reasons] == ["bad_image", "bad_image"]
    assert reasons[0]["reason"].startswith("images[0] (5 bytes) cannot be decoded as an image: cannot identify")
    assert reasons[1]["reason"] == (
        "prompt has 1 '<image>' placeholder(s) but the row has 0 image(s); put one '<image>' in the prompt text "
        "per image"
    )
    # A batch is one (B, k, C, H, W) tensor: the trainer refuses rows with different image counts.
    with pytest.raises(ValueError, match="image rows must all hold the same number and size of images"):
        PromptDataset.from_sources([result.train_url], processor.tokenizer, max_prompt_length=17, processor=processor)
    # max_prompt_length=15 rejects the 17-token two-image row as too long; the rest reads back for training.
    spec = spec.model_copy(update={"max_prompt_length": 15, "max_rejected_fraction": 0.8})
    result = prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r2", tokenizer=processor)
    assert (result.num_train, result.num_rejected) == (1, 3)
    dataset = PromptDataset.from_sources(
        [result.train_url], processor.tokenizer, max_prompt_length=15, processor=processor
    )
    assert [len(p) for p in dataset.prompt_ids] == [15] and dataset.pixel_values is not None
    assert dataset.pixel_values[0].shape == (1, 3, 16, 16)


def test_prepare_refuses_images_with_a_text_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from rlhf_ops.models.resolve import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-llama"))
    spec = PrepareSpec(source="builtin:color_name", limit=4, max_prompt_length=32)
    with pytest.raises(ValueError, match="source rows have images but the tokenizer has no image processor"):
        prepare_dataset(spec, out_url=str(tmp_path / "out"), run_id="r1", tokenizer=tokenizer)


def test_builtin_color_task_batches_carry_pixel_values(processor: Any) -> None:
    rows = make_toy_dataset("color_name", num_rows=8, seed=0)
    assert {r["ground_truth"] for r in rows} <= set(TOY_COLORS) and all(len(r["images"]) == 1 for r in rows)
    dataset = PromptDataset.from_sources(
        ["builtin:color_name"], processor.tokenizer, max_prompt_length=15, toy_rows=8, processor=processor
    )
    batch = dataset.batch([0, 1, 2], pad_token_id=0, uid_prefix="t").tensors
    assert batch["input_ids"].shape == (3, 15) and batch["pixel_values"].shape == (3, 1, 3, 16, 16)
    # CLIP normalisation of a solid colour: every pixel of channel c is (v / 255 - mean_c) / std_c.
    mean, std = processor.image_processor.image_mean, processor.image_processor.image_std
    rgb = TOY_COLORS[dataset.ground_truths[0]]
    expected = torch.tensor([(v / 255 - m) / s for v, m, s in zip(rgb, mean, std, strict=True)])
    torch.testing.assert_close(batch["pixel_values"][0, 0, :, 5, 7], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("response", "score", "acc", "initial"),
    [
        ("red", 1.0, 1.0, 1.0),  # exactly the word
        ("redx", 0.5, 1.0, 1.0),  # the whole word (3/3 x 0.5), then more
        ("re", 0.5 * 2 / 3, 0.0, 1.0),
        ("r", 0.5 / 3, 0.0, 1.0),
        ("blue", 0.0, 0.0, 0.0),  # another colour's word earns nothing
        ("", 0.0, 0.0, 0.0),
    ],
)
def test_color_name_score(response: str, score: float, acc: float, initial: float) -> None:
    out = color_name_score("toy/color_name", response, "red", None)
    assert out == pytest.approx({"score": score, "acc": acc, "initial_acc": initial})
