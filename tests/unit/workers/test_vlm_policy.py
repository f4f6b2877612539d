"""The tiny VLM (``builtin:tiny-vlm``) as a policy.

Files and auto class, the processor (placeholder expansion, chat template), image conditioning, exact
packing, HF rollout with pixel inputs, and FSDP2 units over the vision tower and the language blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration

from rlhf_ops.config.schema import FSDPConfig
from rlhf_ops.data.images import TOY_COLORS, encode_multimodal_prompt, solid_png
from rlhf_ops.models.modality import detect_modality, media_token_ids
from rlhf_ops.models.tiny_vlm import IMAGE_TOKENS_PER_IMAGE, build_tiny_vlm_dir
from rlhf_ops.padding import compute_position_ids, pad_sequences_left
from rlhf_ops.protocol import DataProto
from tests.support.rollout_calls import sampling_for
from workers.actor.forward import response_log_probs
from workers.fsdp import apply_fsdp2, build_device_mesh, find_decoder_blocks, load_hf_model
from workers.rollout.hf_rollout import HFRollout

PROMPT = [{"role": "user", "content": "<image>colour?"}]


def _batch(model_dir: str, colors: list[str]) -> DataProto:
    """One solid image per prompt; odd rows have a longer text, so the batch is really left-padded.

    Returns input_ids / attention_mask / position_ids (B, P) and pixel_values (B, 1, 3, 16, 16).
    """
    processor = AutoProcessor.from_pretrained(model_dir)
    prompts = [
        PROMPT if i % 2 == 0 else [{"role": "user", "content": "<image>which colour?"}] for i in range(len(colors))
    ]
    encoded = [
        encode_multimodal_prompt(p, [solid_png(TOY_COLORS[c])], processor, apply_chat_template=True)
        for p, c in zip(prompts, colors, strict=True)
    ]
    ids = [e[0] for e in encoded]
    mask = pad_sequences_left([[1] * len(s) for s in ids], pad_value=0)
    tensors = {
        "input_ids": pad_sequences_left(ids, pad_value=0),
        "attention_mask": mask,
        "position_ids": compute_position_ids(mask),
        "pixel_values": torch.stack([e[1] for e in encoded]),
    }
    return DataProto.from_dict(tensors)


def test_dir_is_a_llava_with_a_processor_and_loads_with_the_image_text_auto_class(tiny_vlm_dir: str) -> None:
    names = {p.name for p in Path(tiny_vlm_dir).iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"} <= names
    config = json.loads((Path(tiny_vlm_dir) / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"] and detect_modality(tiny_vlm_dir) == (
        "vision_language"
    )
    # 84 char-level ids + "<image>" = 85; "<image>" is the last id.
    assert config["text_config"]["vocab_size"] == 85 and config["image_token_index"] == 84
    assert (
        config["image_seq_length"] == 4
        and config["vision_config"]["image_size"] == 16
        and config["vision_config"]["patch_size"] == 8
    )
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    assert isinstance(model, LlavaForConditionalGeneration)
    # Same seed, same bytes: a second build into another folder is identical.
    again = build_tiny_vlm_dir(Path(tiny_vlm_dir).parent / "tiny-vlm-again")
    assert (again / "model.safetensors").read_bytes() == (Path(tiny_vlm_dir) / "model.safetensors").read_bytes()
    assert build_tiny_vlm_dir(tiny_vlm_dir) == Path(tiny_vlm_dir)  # reused, not rebuilt


def test_chat_template_keeps_the_placeholder_and_the_processor_expands_it(tiny_vlm_dir: str) -> None:
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    text = processor.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|><image>colour?\n<|assistant|>"
    # HF-style content parts render the same text.
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    assert processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == text
    ids, pixel_values = encode_multimodal_prompt(PROMPT, [solid_png((1, 2, 3))], processor, apply_chat_template=True)
    # (16 / 8)^2 = 4 patch tokens (CLS dropped): bos, <|user|>, 4 x <image>, 7 chars, "\n", <|assistant|> = 15.
    assert IMAGE_TOKENS_PER_IMAGE == 4 and len(ids) == 15 and ids[2:6] == [84] * 4
    assert pixel_values.shape == (1, 3, 16, 16)


def test_the_image_changes_the_next_token_distribution(tiny_vlm_dir: str) -> None:
    model = load_hf_model(tiny_vlm_dir, kind="causal_lm", attn_implementation="eager").eval()
    batch = _batch(tiny_vlm_dir, ["red", "blue", "red"]).batch
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            pixel_values=batch["pixel_values"].flatten(0, 1),
        ).logits[:, -1]
    torch.testing.assert_close(logits[0], logits[2])  # same image, same prompt
    assert (logits[0] - logits[1]).abs().max() > 1e-4  # only the image differs


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_rollout_log_probs_match_padded_and_packed_recompute(tiny_vlm_dir: str, attn: str) -> None:
    model = load_hf_model(tiny_vlm_dir, kind="causal_lm", attn_implementation=attn)
    prompts = _batch(tiny_vlm_dir, ["red", "green", "blue"])
    engine = HFRollout(model, pad_token_id=0, eos_token_id=2, response_length=5, seed=3)
    out = engine.generate_sequences(prompts, sampling_for(engine, n=2)).tensors
    # Row i is sample i % 2 of prompt i // 2: the images were repeated the same way.
    torch.testing.assert_close(out["pixel_values"], prompts.tensors["pixel_values"].repeat_interleave(2, dim=0))
    mask = out["response_mask"].bool()
    for remove_padding in (False, True):
        log_probs, _ = response_log_probs(
            model,
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
            response_length=5,
            use_remove_padding=remove_padding,
            pixel_values=out["pixel_values"],
        )
        torch.testing.assert_close(log_probs[mask], out["rollout_log_probs"][mask], atol=1e-5, rtol=0)


def test_rollout_never_samples_the_image_placeholder(tiny_vlm_dir: str) -> None:
    model = load_hf_model(tiny_vlm_dir, kind="causal_lm", attn_implementation="eager")
    assert media_token_ids(model.config) == [84] and media_token_ids(None) == []
    prompts = _batch(tiny_vlm_dir, ["red", "green", "blue"])
    counts = []
    for suppress in ((), media_token_ids(model.config)):
        engine = HFRollout(
            model, pad_token_id=0, eos_token_id=2, response_length=7, seed=5, suppress_token_ids=suppress
        )
        responses = engine.generate_sequences(prompts, sampling_for(engine, n=16)).tensors["responses"]
        counts.append(int((responses == 84).sum()))
    # 48 rows x 7 tokens at ~1/85 each: the random policy samples "<image>" a few times unless suppressed.
    assert counts[0] > 0 and counts[1] == 0


def test_fsdp2_shards_the_vision_tower_and_the_language_blocks(gloo_world1: None, tiny_vlm_dir: str) -> None:
    plain = load_hf_model(tiny_vlm_dir, kind="causal_lm", attn_implementation="eager")
    wrapped = load_hf_model(tiny_vlm_dir, kind="causal_lm", attn_implementation="eager")
    blocks = find_decoder_blocks(wrapped)  # LLaVA's _no_split_modules: vision and language block classes
    # 2 CLIP encoder layers + the patch/position embeddings of the vision tower, 2 Llama decoder layers.
    units = sorted(type(m).__name__ for m in blocks)
    assert units == ["CLIPEncoderLayer"] * 2 + ["CLIPVisionEmbeddings"] + ["LlamaDecoderLayer"] * 2
    apply_fsdp2(wrapped, build_device_mesh(1), FSDPConfig())
    assert all(isinstance(m, FSDPModule) for m in blocks) and isinstance(wrapped, FSDPModule)
    batch = _batch(tiny_vlm_dir, ["yellow", "green"]).batch
    outputs = [_forward_sum(model, batch) for model in (plain, wrapped)]
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-6, rtol=0)
    # The vision tower gets gradients through the policy loss (it trains with the language model).
    patch = wrapped.model.vision_tower.embeddings.patch_embedding.weight
    assert patch.grad is not None and patch.grad.full_tensor().abs().sum() > 0


def _forward_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        pixel_values=batch["pixel_values"].flatten(0, 1),
    ).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach()
