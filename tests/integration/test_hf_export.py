"""HF export of real checkpoints (issue 4): a 2-rank FSDP2 actor trained one step, saved with DCP, exported
with ``rlhf export``, loaded with ``from_pretrained``; LoRA merge; loading never runs pickled code.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path, PosixPath
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_ops.checkpoint.dcp_reader import (
    LORA_SCALING_FILE,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_model_state_dict,
)
from rlhf_ops.checkpoint.export import EXPORT_INFO_FILE, export_hf_model
from rlhf_ops.checkpoint.manager import CheckpointManager
from rlhf_ops.cli import main as rlhf_main
from rlhf_ops.config import dump_config, load_config
from rlhf_ops.padding import compute_position_ids
from rlhf_ops.protocol import DataProto
from rlhf_ops.storage.manifest import read_manifest, update_latest, verify_checkpoint, write_manifest
from tests.support.moto_server import free_port
from tests.support.training import start_actor_group
from workers.actor.actor_rollout_ref_worker import ActorRolloutRefWorker
from workers.checkpointing import save_role_checkpoint
from workers.clients import ActorRolloutRefClient
from workers.single_controller.resource_pool import RayResourcePool
from workers.single_controller.worker_group import RayWorkerGroup

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]

# One fixed input for every logits comparison: (2, 9) token ids of the tiny vocabulary (84 ids).
INPUT_IDS = torch.tensor([[1, 5, 19, 31, 32, 41, 71, 69, 13], [1, 40, 12, 12, 60, 7, 8, 9, 22]])


def _logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits  # (2, 9, 84)


def _group(model_dir: str, world: int) -> tuple[RayResourcePool, RayWorkerGroup]:
    config = load_config("tiny-cpu", [f"resources.nproc_per_node={world}", "rollout.n=2"])
    return start_actor_group(model_dir, config, role="actor", name="export_actor", pool_name=f"export{world}")


def _training_batch(num: int = 32, *, prompt_len: int = 5, resp_len: int = 6) -> DataProto:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 60, (num, prompt_len), generator=g)
    responses = torch.randint(10, 60, (num, resp_len), generator=g)
    attention_mask = torch.ones(num, prompt_len + resp_len, dtype=torch.long)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_ids(attention_mask),
            "response_mask": torch.ones(num, resp_len, dtype=torch.long),
            "old_log_probs": -4.0 + 0.1 * torch.randn(num, resp_len, generator=g),
            "advantages": torch.randn(num, resp_len, generator=g),
            "ref_log_prob": -4.0 + 0.1 * torch.randn(num, resp_len, generator=g),
        }
    )


class _StepState:
    """The trainer side of ``CheckpointManager.save``: the state it writes to ``trainer_state.json``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["global_step"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[dict[str, Any]]:
    """A 2-rank actor after one PPO update, its committed checkpoint, and its gathered full weights."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "resolved_config.yaml").write_text(
        dump_config(load_config("tiny-cpu", [f"model.path={tiny_model_dir}"]))
    )
    pool, group = _group(tiny_model_dir, 2)
    try:
        client = ActorRolloutRefClient(group)
        metrics = client.update_actor(_training_batch(), step=1)
        assert metrics["actor/grad_norm"] > 0
        ckpt = run_dir / "global_step_1"
        client.save_checkpoint(str(ckpt / "actor"))
        write_manifest(ckpt, step=1)
        update_latest(run_dir, 1)
        full = group.call(ActorRolloutRefWorker.full_state_dict)
        assert full[1] == {} and len(full[0]) == 21  # rank 0 holds the gathered weights
        yield {"run_dir": run_dir, "ckpt": ckpt, "weights": full[0], "group": group, "client": client}
    finally:
        group.shutdown()
        pool.shutdown()


def test_rlhf_export_writes_a_model_with_the_trained_weights_and_logits(
    trained: dict[str, Any], tiny_model_dir: str, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    # No --base-model: the base is the run's model.path from <run_dir>/resolved_config.yaml.
    assert rlhf_main(["export", str(trained["ckpt"]), str(out)]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", EXPORT_INFO_FILE} <= {
        p.name for p in out.iterdir()
    }
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left behind
    umask = os.umask(0o022)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # safetensors alone writes 0600
    exported = AutoModelForCausalLM.from_pretrained(out)
    weights: dict[str, torch.Tensor] = trained["weights"]
    state = exported.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name

    trained_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_logits = _logits(trained_model)
    trained_model.load_state_dict(weights, strict=True)
    want = _logits(trained_model)
    got = _logits(exported)
    assert torch.equal(got, want)  # atol 0
    assert (want - base_logits).abs().max() > 1e-3  # one update moved the model: the test can fail

    assert rlhf_main(["export", str(trained["ckpt"]), str(out)]) == 2  # never overwritten by accident


def test_a_2_rank_checkpoint_loads_bitwise_into_a_fresh_1_rank_group(
    trained: dict[str, Any], tiny_model_dir: str
) -> None:
    pool, group = _group(tiny_model_dir, 1)
    try:
        ActorRolloutRefClient(group).load_checkpoint(str(trained["ckpt"] / "actor"))
        [reloaded] = group.call(ActorRolloutRefWorker.full_state_dict)
    finally:
        group.shutdown()
        pool.shutdown()
    assert set(reloaded) == set(trained["weights"])
    for name, tensor in trained["weights"].items():
        assert torch.equal(reloaded[name], tensor), name


def test_save_hf_model_writes_hf_inside_the_checkpoint_before_the_manifest(
    trained: dict[str, Any], tiny_model_dir: str, tmp_path: Path
) -> None:
    manager = CheckpointManager(tmp_path, roles={"actor": trained["client"]}, hf_base_model_path=tiny_model_dir)
    ckpt = manager.save(_StepState(7))
    listed = {entry.path for entry in read_manifest(ckpt).files}
    assert {"hf/model.safetensors", "hf/config.json", "hf/tokenizer.json"} <= listed  # hashed: written before
    assert verify_checkpoint(ckpt) == []
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in trained["weights"].items())


def test_export_refuses_a_corrupted_checkpoint_naming_the_file(
    trained: dict[str, Any], tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "global_step_1"
    shutil.copytree(trained["ckpt"], ckpt)
    shard = ckpt / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    code = rlhf_main(["export", str(ckpt), str(tmp_path / "out"), "--base-model", tiny_model_dir])
    assert code == 2 and "actor/__0_0.distcp: sha256 mismatch" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def single_rank_process_group() -> Iterator[None]:
    """A 1-rank gloo group in this process, for ``save_role_checkpoint`` of a plain (non-FSDP) model."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("single_rank_process_group")
def test_lora_adapters_are_merged_like_peft_merge_and_unload(tiny_model_dir: str, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    # rsLoRA: scaling = alpha / sqrt(r) = 8 / 2 = 4 (plain LoRA would be 8 / 4 = 2); B random, not zero.
    lora = LoraConfig(
        r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    ckpt = tmp_path / "global_step_3"
    save_role_checkpoint(str(ckpt / "actor"), peft_model, optimizer, None)
    scalings = (ckpt / "actor" / LORA_SCALING_FILE).read_text()
    assert '"base_model.model.model.layers.0.self_attn.q_proj": {\n  "default": 4.0' in scalings
    write_manifest(ckpt, step=3)

    unmerged = _logits(peft_model)
    merged_model = peft_model.merge_and_unload()
    out = export_hf_model(ckpt, tmp_path / "hf", base_model_path=tiny_model_dir)
    exported = AutoModelForCausalLM.from_pretrained(out)
    merged = merged_model.state_dict()
    assert set(exported.state_dict()) == set(merged)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, merged[name]), name
    assert torch.equal(_logits(exported), _logits(merged_model))
    torch.testing.assert_close(_logits(exported), unmerged, atol=1e-5, rtol=0)  # merge vs adapter path: fp order
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert (_logits(base) - unmerged).abs().max() > 1e-2  # the adapters matter


class _Touch:
    """Pickles to ``Path(marker).touch()``: harmless, but proves whether unpickling ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def test_loading_never_runs_pickled_code(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = tmp_path / "actor"
    # A non-tensor value (as optimizer hyper-parameters are) that runs code when unpickled.
    marker = tmp_path / "ran"
    dcp.save({"model": {"w": torch.ones(3)}, "extra": _Touch(marker)}, checkpoint_id=str(ckpt), no_dist=True)
    assert not marker.exists()
    state: dict[str, Any] = {"model": {"w": torch.zeros(3)}, "extra": None}
    with pytest.raises(CheckpointException, match="Weights only load failed"):  # DCP wraps the UnpicklingError
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()
    dcp.load({"model": {"w": torch.zeros(3)}, "extra": None}, checkpoint_id=str(ckpt), no_dist=True)
    assert marker.exists()  # torch's default planner (weights_only=False) did run it: the guard is needed
    marker.unlink()

    # A tampered .metadata: plain pickle.load (torch's FileSystemReader) would run it; ours refuses.
    payload = io.BytesIO()
    pickle.dump(_Touch(marker), payload)
    (ckpt / ".metadata").write_bytes(payload.getvalue())
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        read_model_state_dict(ckpt)
    assert not marker.exists()
    assert os.listdir(ckpt)  # untouched otherwise


class _Py3112Pickler(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.4 does (``getattr(EnumClass, "NAME")``)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_from_a_python_3_11_2_writer_loads_and_getattr_stays_confined(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    # The podman stack's Ray image runs Debian bookworm's Python 3.11.2: its .metadata holds builtins.getattr.
    ckpt = tmp_path / "actor"
    dcp.save({"model": {"w": torch.arange(3.0)}}, checkpoint_id=str(ckpt), no_dist=True)
    with (ckpt / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    payload = io.BytesIO()
    _Py3112Pickler(payload).dump(metadata)
    assert b"getattr" in payload.getvalue()
    (ckpt / ".metadata").write_bytes(payload.getvalue())
    assert torch.equal(read_model_state_dict(ckpt)["w"], torch.arange(3.0))

    # getattr on anything but an allow-listed enum is refused before it runs.
    evil = io.BytesIO()
    pickle.Pickler(evil).dump(_GetattrNonEnum())
    (ckpt / ".metadata").write_bytes(evil.getvalue())
    with pytest.raises(pickle.UnpicklingError, match="not an allowed enum"):
        read_model_state_dict(ckpt)


class _GetattrNonEnum:
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (getattr, (PosixPath, "touch"))  # an allow-listed class, but not an enum
