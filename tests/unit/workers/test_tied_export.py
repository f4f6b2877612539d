"""A tied-embedding model stored in bf16 through the FSDP2 loader, one update, DCP save and ``rlhf export``.

The model is the tiny Llama with ``tie_word_embeddings=True`` saved in bf16 (as SmolLM2 ships): the trainer
must hold fp32 master weights whatever the disk dtype, keep ``lm_head.weight`` the same tensor as
``model.embed_tokens.weight`` through FSDP2 and training, and the export must reload tied with equal logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_ops.checkpoint.export import export_hf_model
from rlhf_ops.config.schema import FSDPConfig
from workers.checkpointing import save_role_checkpoint
from workers.fsdp import build_device_mesh, build_fsdp_model

IDS = torch.tensor([[1, 5, 19, 31, 32, 41, 71], [1, 40, 12, 12, 60, 7, 8]])  # (2, 7) ids of the 84-token vocab


@pytest.fixture(scope="module")
def tied_bf16_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("tied") / "tiny-tied-bf16"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tie to the embedding (the head's values are dropped)
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


def _keys(model_dir: str | Path) -> tuple[set[str], set[str]]:
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return set(f.keys()), {str(f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def test_tied_bf16_model_trains_tied_in_fp32_and_exports_tied(
    gloo_world1: None, tied_bf16_dir: str, tmp_path: Path
) -> None:
    keys, dtypes = _keys(tied_bf16_dir)
    assert "lm_head.weight" not in keys and dtypes == {"torch.bfloat16"}  # the fixture is what SmolLM2 looks like
    mesh = build_device_mesh(1)
    model = build_fsdp_model(tied_bf16_dir, kind="causal_lm", mesh=mesh, cfg=FSDPConfig(), device="cpu")
    embed, head = model.get_parameter("model.embed_tokens.weight"), model.get_parameter("lm_head.weight")
    assert head is embed and {p.dtype for p in model.parameters()} == {torch.float32}
    # One SGD step: the head's and the embedding's gradients both land in the one tensor.
    before = embed.full_tensor().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    _logits_grad = model(input_ids=IDS).logits
    (_logits_grad[..., 5].sum() - _logits_grad[..., 7].sum()).backward()
    optimizer.step()
    after = embed.full_tensor()
    assert model.get_parameter("lm_head.weight") is model.get_parameter("model.embed_tokens.weight")
    assert (after - before).abs().max() > 1e-3  # it trained (the rows of ids 5 and 7 moved most)
    expected = _logits(model)

    ckpt = tmp_path / "global_step_1"
    save_role_checkpoint(str(ckpt / "actor"), model, None, None)
    out = export_hf_model(ckpt, tmp_path / "hf", base_model_path=tied_bf16_dir, verify=False)

    keys, dtypes = _keys(out)
    assert "lm_head.weight" not in keys and dtypes == {"torch.float32"}  # stays tied on disk, fp32 as trained
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, after, atol=0, rtol=0)
    torch.testing.assert_close(_logits(reloaded), expected, atol=1e-5, rtol=0)
