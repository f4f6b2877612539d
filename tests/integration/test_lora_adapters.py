"""Adapter-only LoRA: a checkpoint of the adapters and their optimizer state resumes exactly, exports to the same
merged model as a full checkpoint, and every LoRA export carries a PEFT adapter folder that loads onto the base.

In-process, on a 1-rank gloo group, with the tiny Llama and LoRA on every linear layer.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from rlhf_ops.checkpoint.export import export_hf_model
from rlhf_ops.cli import main as rlhf_main
from rlhf_ops.config.schema import ActorConfig, AlgorithmConfig, FSDPConfig, LoraConfig
from tests.unit.workers.fsdp_test_batch import make_plan, make_ppo_batch
from workers.actor.dp_actor import DataParallelPPOActor
from workers.adapter_state import checkpoint_model_keys
from workers.checkpointing import load_role_checkpoint, save_role_checkpoint
from workers.fsdp import build_device_mesh, build_optimizer
from workers.fsdp.wrap import build_fsdp_model

pytestmark = pytest.mark.integration

LORA = LoraConfig(rank=4, alpha=8, target_modules="all-linear", save_adapter_only=True)
NUM_ADAPTER_PARAMS = 7 * 2 * 2  # 7 linears x 2 blocks, A and B


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    owned = not dist.is_initialized()
    if owned:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def _actor(model_dir: str, *, seed: int, lora: LoraConfig | None = LORA) -> DataParallelPPOActor:
    torch.manual_seed(seed)  # lora_A is drawn from the global RNG
    model = build_fsdp_model(
        model_dir, kind="causal_lm", mesh=build_device_mesh(1), cfg=FSDPConfig(), device="cpu", lora=lora
    )
    optimizer = build_optimizer(model, ActorConfig().optim.model_copy(update={"lr": 1e-2}))
    return DataParallelPPOActor(
        model, optimizer, config=ActorConfig(), algorithm=AlgorithmConfig(), plan=make_plan(), device="cpu"
    )


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param  # type: ignore[no-any-return]


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p).detach().clone() for n, p in model.named_parameters()}


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def trained(gloo: None, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One LoRA update, saved both ways: ``adapter/actor`` (adapter-only) and ``full/actor``."""
    root = tmp_path_factory.mktemp("lora_ckpt")
    actor = _actor(tiny_model_dir, seed=0)
    actor.update_policy(make_ppo_batch(batch_size=8, seed=3))
    for kind, adapter_only in (("adapter", True), ("full", False)):
        save_role_checkpoint(
            str(root / kind / "actor"), actor.module, actor.optimizer, None, adapter_only=adapter_only
        )
    return {"root": root, "actor": actor}


def test_adapter_only_checkpoint_holds_the_adapters_and_is_smaller(trained: dict[str, object]) -> None:
    root, actor = Path(str(trained["root"])), trained["actor"]
    assert isinstance(actor, DataParallelPPOActor)
    adapter_keys = checkpoint_model_keys(str(root / "adapter" / "actor"))
    assert len(adapter_keys) == NUM_ADAPTER_PARAMS and all(".lora_" in k for k in adapter_keys)
    full_keys = checkpoint_model_keys(str(root / "full" / "actor"))
    assert adapter_keys < full_keys and len(full_keys) == NUM_ADAPTER_PARAMS + 21  # + the 21 base tensors
    # Tiny Llama (hidden 64) with r=4 adapters on every linear: the adapters are a third of the base, and both
    # checkpoints hold them with their two Adam moments, so full / adapter-only is about 2.2 here (SmolLM2-135M at
    # r=8: see docs/lora_adapters.md).
    ratio = _bytes(root / "full" / "actor") / _bytes(root / "adapter" / "actor")
    assert ratio > 2.0, ratio
    config = json.loads((root / "adapter" / "actor" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")


def test_adapter_only_checkpoint_resumes_bit_for_bit(trained: dict[str, object], tiny_model_dir: str) -> None:
    root, actor = Path(str(trained["root"])), trained["actor"]
    assert isinstance(actor, DataParallelPPOActor)
    fresh = _actor(tiny_model_dir, seed=123)  # another lora_A draw: the load must overwrite it
    assert not torch.equal(*(_weights(m)[k] for m in (fresh.module, actor.module) for k in [_a_name(actor)]))
    load_role_checkpoint(str(root / "adapter" / "actor"), fresh.module, fresh.optimizer, None)
    expected, loaded = _weights(actor.module), _weights(fresh.module)
    assert expected.keys() == loaded.keys()
    for name in expected:  # base weights from model.path, adapters from the checkpoint: all bit-identical
        assert torch.equal(loaded[name], expected[name]), name
    # The optimizer's moments came back too: one more update moves both models identically.
    batch = make_ppo_batch(batch_size=8, seed=4)
    m_ref, m_resumed = actor.update_policy(batch), fresh.update_policy(batch)
    assert m_ref["actor/pg_loss"] == m_resumed["actor/pg_loss"]
    assert m_ref["actor/grad_norm"] == m_resumed["actor/grad_norm"] and m_ref["actor/grad_norm"] > 0
    after, after_resumed = _weights(actor.module), _weights(fresh.module)
    assert all(torch.equal(after[n], after_resumed[n]) for n in after)
    assert not torch.equal(after[_a_name(actor)], expected[_a_name(actor)])  # the update did move the adapter


def _a_name(actor: DataParallelPPOActor) -> str:
    return next(n for n, _ in actor.module.named_parameters() if ".lora_A." in n)


def test_adapter_only_export_merges_like_a_full_one_and_writes_the_adapter_folder(
    trained: dict[str, object], tiny_model_dir: str, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = Path(str(trained["root"]))
    kw = {"base_model_path": tiny_model_dir, "verify": False}
    from_adapter = export_hf_model(root / "adapter", tmp_path / "from_adapter", **kw)  # type: ignore[arg-type]
    from_full = export_hf_model(root / "full", tmp_path / "from_full", **kw)  # type: ignore[arg-type]
    merged_a, merged_f = (load_file(str(d / "model.safetensors")) for d in (from_adapter, from_full))
    assert merged_a.keys() == merged_f.keys()
    assert all(torch.equal(merged_a[k], merged_f[k]) for k in merged_a)
    for export in (from_adapter, from_full):
        files = sorted(p.name for p in (export / "adapter").iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((from_adapter / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model_dir
    # PEFT loads the adapter folder onto the base model and computes what the merged export computes.
    ids = torch.randint(4, 84, (2, 9), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), from_adapter / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(from_adapter)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
        torch.testing.assert_close(peft(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert (base(input_ids=ids).logits - expected).abs().max() > 1e-3  # the adapter changes the model


def test_adapter_only_export_via_the_cli_and_its_refusal_without_lora(
    trained: dict[str, object], tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(str(trained["root"]))
    assert rlhf_main(["export", str(root / "adapter"), str(tmp_path / "a"), "--base-model", tiny_model_dir]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err  # uncommitted: the CLI verifies the manifest
    out = export_hf_model(
        root / "adapter", tmp_path / "only", base_model_path=tiny_model_dir, verify=False, adapter_only=True
    )
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert len(load_file(str(out / "adapter_model.safetensors"))) == NUM_ADAPTER_PARAMS

    plain = _actor(tiny_model_dir, seed=0, lora=None)
    save_role_checkpoint(str(tmp_path / "plain" / "actor"), plain.module, plain.optimizer, None)
    with pytest.raises(ValueError, match=r"holds no LoRA adapters .*model\.lora\.rank=0.*without --adapter-only"):
        export_hf_model(
            tmp_path / "plain", tmp_path / "x", base_model_path=tiny_model_dir, verify=False, adapter_only=True
        )
    with pytest.raises(ValueError, match=r"model\.lora\.save_adapter_only is set but the model has no trainable"):
        save_role_checkpoint(str(tmp_path / "p2"), plain.module, None, None, adapter_only=True)
