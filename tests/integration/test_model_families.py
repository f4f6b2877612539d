"""The architectures users bring, through the real path: Qwen2, Qwen3, Mistral, Gemma 2 and Phi-3.

Each family is a tiny random model built from its transformers config class (``tests.support.tiny_families``:
what sets the family apart is switched on: q/k/v biases, q/k norms, GQA and sliding window, norm offsets and
soft-capping, fused q/k/v and gate/up). Per family:

- default (no Ray, ~1 s each): remove padding is exact (the packed forward's response log-probs equal the padded
  forward's), and an HF export of a DCP checkpoint reloads with bit-identical logits;
- slow (~60-90 s each): two GRPO steps of the tiny-cpu preset on the family with the vLLM rollout (weights
  synced into the engine every step, remove padding on), the rollout/actor log-prob difference below 1e-4 after
  every sync, and the step-2 checkpoint's HF export reloading with the actor's logits. Gemma 2 found that vLLM's
  Gemma has no ``lm_head`` (the embedding is its head) and refused the tied alias the sync sends; the engine now
  drops it for such models (``workers/rollout/vllm_rollout.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_families import FAMILIES, build_tiny_family_dir

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

DIFF_TOL = 1e-4  # |p_rollout - p_actor| in fp32, the bound of training/rollout_probs_diff_max
VOCAB = 84
R = 5


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: str(build_tiny_family_dir(root / family, family)) for family in FAMILIES}


def _load(model_dir: str | Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each (4, 11): left-padded prompts (6), right-padded responses (R)."""
    from rlhf_ops.padding import compute_position_ids

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6 + R, dtype=torch.long)
    mask[0, :3] = 0  # prompt padding
    mask[1, :1] = 0
    mask[2, -2:] = 0  # responses that ended early
    mask[3, -4:] = 0
    ids = torch.randint(4, VOCAB, (4, 6 + R), generator=g) * mask
    return ids, mask, compute_position_ids(mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_remove_padding_gives_the_padded_log_probs(family_dirs: dict[str, str], family: str) -> None:
    from workers.actor.forward import response_log_probs

    model = _load(family_dirs[family])
    ids, mask, pos = _padded_batch()
    with torch.no_grad():
        padded, _ = response_log_probs(model, input_ids=ids, attention_mask=mask, position_ids=pos, response_length=R)
        packed, _ = response_log_probs(
            model, input_ids=ids, attention_mask=mask, position_ids=pos, response_length=R, use_remove_padding=True
        )
    valid = mask[:, -R:].bool()
    # Same fp32 math on differently shaped tensors: equal up to summation order (measured: 4.8e-7).
    torch.testing.assert_close(packed[valid], padded[valid], rtol=0, atol=1e-5)
    assert padded[valid].lt(0).all()  # real log-probs, not masked zeros


def _export_logits(model_dir: str, weights: dict[str, torch.Tensor], tmp: Path) -> torch.Tensor:
    """Logits (4, 11, V) of the HF export of a 1-process DCP checkpoint holding ``weights``."""
    import torch.distributed.checkpoint as dcp

    from rlhf_ops.checkpoint.export import export_hf_model

    ckpt = tmp / "global_step_1"
    dcp.save({"model": weights}, checkpoint_id=str(ckpt / "actor"), no_dist=True)
    out = export_hf_model(ckpt, tmp / "hf", base_model_path=model_dir, verify=False)
    card = (out / "README.md").read_text()  # every export carries its model card
    assert f'base_model: "{model_dir}"' in card and "global_step_1`, step 1" in card
    ids, mask, pos = _padded_batch()
    with torch.no_grad():
        return _load(out)(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_reloads_with_identical_logits(family_dirs: dict[str, str], family: str, tmp_path: Path) -> None:
    model = _load(family_dirs[family])
    with torch.no_grad():  # "trained" weights: every tensor moved, so an export of the base weights fails
        g = torch.Generator().manual_seed(1)
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=g))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # FSDP's state dict holds a tied tensor once; so does the checkpoint
        weights.pop("lm_head.weight", None)
    ids, mask, pos = _padded_batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(_export_logits(family_dirs[family], weights, tmp_path), expected)


# --------------------------------------------------------------------------------------------- slow: vLLM GRPO
def _grpo_two_steps(model_dir: str, root: Path) -> tuple[list[dict[str, float]], Path]:
    from rlhf_ops.config import load_config
    from workers.entrypoints.train import run_training

    overrides = [
        f"model.path={model_dir}",
        f"trainer.checkpoint_root={root}",
        "rollout.engine=vllm",
        "rollout.kv_cache_memory_bytes=67108864",
        "rollout.max_new_tokens=4",
        "actor.use_remove_padding=true",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "data.val_files=[]",
        "data.toy_rows=64",
    ]
    config = load_config("tiny-cpu", overrides)
    run_training(config)
    run_dir = root / config.trainer.experiment_name / config.trainer.run_name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, run_dir / "global_step_2"


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("family", FAMILIES)
def test_two_grpo_steps_with_vllm_rollout(family_dirs: dict[str, str], family: str, tmp_path: Path) -> None:
    from rlhf_ops.checkpoint.dcp_reader import read_model_state_dict
    from rlhf_ops.checkpoint.export import export_hf_model

    rows, ckpt = _grpo_two_steps(family_dirs[family], tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        assert row["timing_s/worker/update_weights"] > 0  # the actor's weights reached vLLM before the rollout
        # ... and vLLM generated with exactly them: its token probabilities equal the actor's recompute.
        assert row["training/rollout_probs_diff_max"] < DIFF_TOL, (family, row["training/rollout_probs_diff_max"])
        assert row["response_length/mean"] > 0
    # The step-2 checkpoint's export reloads with the trained weights' logits (not the base model's).
    weights = read_model_state_dict(ckpt / "actor")
    trained = _load(family_dirs[family])
    trained.load_state_dict(weights, strict=not trained.config.tie_word_embeddings)
    export = export_hf_model(ckpt, tmp_path / "hf", base_model_path=family_dirs[family])
    ids, mask, pos = _padded_batch()
    with torch.no_grad():
        expected = trained(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        base = _load(family_dirs[family])(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert torch.equal(_load(export)(input_ids=ids, attention_mask=mask, position_ids=pos).logits, expected)
    assert not torch.equal(expected, base)  # two steps moved the policy
