"""A step's batch through Parquet and back (``trainer.dump_rollouts``), the dump's manifest and store copy, and the
replay's checks of the weights it was dumped from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_ops.config import ConfigError, load_config
from rlhf_ops.protocol import DataProto
from rlhf_ops.trainer.rollout_dump import (
    RolloutRecorder,
    RolloutReplay,
    batch_to_table,
    model_fingerprint,
    table_to_batch,
)


def _batch(rows: int = 4) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    meta = np.empty(rows, dtype=object)
    meta[:] = [{"answer": str(i), "tags": [i, i + 1]} for i in range(rows)]
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 100, (rows, 7), generator=gen),
            "response_mask": torch.randint(0, 2, (rows, 3), generator=gen).bool(),
            "rollout_log_probs": torch.randn(rows, 3, generator=gen),
            "token_level_scores": torch.randn(rows, 3, generator=gen).bfloat16(),
            "pixel_values": torch.randn(rows, 2, 2, 2, generator=gen),
        },
        non_tensors={
            "uid": np.array([f"u{i // 2}" for i in range(rows)], dtype=object),
            "data_source": np.array(["copy"] * rows, dtype=object),
            "reward_model": meta,
        },
    )


def test_a_batch_round_trips_bit_for_bit_with_its_dtypes_shapes_columns_and_policy_version() -> None:
    batch = _batch()
    extra = {"acc": [1.0, 0.0, 1.0, 0.5]}
    back, got_extra, version = table_to_batch(batch_to_table(batch, extra=extra, policy_version=6))
    assert version == 6 and got_extra == extra
    for key in map(str, batch.tensors.keys()):
        want: torch.Tensor = batch.tensors[key]
        got: torch.Tensor = back.tensors[key]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert list(back.non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1"]
    assert back.non_tensor_batch["reward_model"][3] == {"answer": "3", "tags": [3, 4]}


def _model(tmp_path: Path, weights: bytes) -> str:
    folder = tmp_path / f"model-{weights.hex()}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def test_the_recorder_writes_manifest_and_steps_locally_and_to_the_store_and_replay_reads_them(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    config = load_config(
        "tiny-cpu", [f"trainer.checkpoint_root={tmp_path / 'ckpt'}", f"trainer.remote_store_url=file://{store}"]
    )
    model = _model(tmp_path, b"\x01\x02")
    recorder = RolloutRecorder(config, model_dir=model, total_steps=2)
    metrics: dict[str, float] = {}
    recorder.dump(1, _batch(), extra={}, metrics=metrics)
    recorder.dump(2, _batch(), extra={}, metrics={"training/policy_lag": 1.0})
    local = tmp_path / "ckpt" / "tiny-cpu" / "demo" / "rollouts"
    remote = store / "tiny-cpu" / "demo" / "rollouts"
    names = ["manifest.json", "step_000001.parquet", "step_000002.parquet"]
    assert sorted(p.name for p in local.iterdir()) == names
    assert sorted(p.name for p in remote.iterdir()) == names
    manifest = json.loads((remote / "manifest.json").read_text())
    assert manifest["model"] == {"path": "builtin:tiny-llama", "fingerprint": model_fingerprint(model)}
    assert manifest["rollout.n"] == 16 and manifest["total_steps"] == 2

    replay = RolloutReplay(str(local), model_dir=model, total_steps=2)
    got: dict[str, float] = {}
    batch = replay.batch(2, got)
    assert torch.equal(batch.tensors["input_ids"], _batch().tensors["input_ids"])
    scores = _batch().tensors["token_level_scores"].sum(-1).float()
    assert got["train/copy/reward/mean"] == pytest.approx(scores.mean().item(), rel=1e-6)


def test_replay_refuses_other_weights_and_a_run_longer_than_the_dump(tmp_path: Path) -> None:
    config = load_config("tiny-cpu", [f"trainer.checkpoint_root={tmp_path / 'ckpt'}"])
    recorder = RolloutRecorder(config, model_dir=_model(tmp_path, b"\x01"), total_steps=1)
    recorder.dump(1, _batch(), extra={}, metrics={})
    with pytest.raises(ConfigError, match=r"trainer.replay_rollouts: .* dumped from other weights"):
        RolloutReplay(str(recorder.dir), model_dir=_model(tmp_path, b"\x02"), total_steps=1)
    with pytest.raises(ConfigError, match=r"no batch for step\(s\) \[2, 3\].*total_training_steps=1"):
        RolloutReplay(str(recorder.dir), model_dir=_model(tmp_path, b"\x01"), total_steps=3)
