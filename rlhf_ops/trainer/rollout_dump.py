"""``trainer.dump_rollouts`` and ``trainer.replay_rollouts``: each step's scored batch as Parquet, and training
from such a dump without a rollout engine.

Layout of a dump (``<run folder>/rollouts/``, copied to ``<remote_store_url>/<experiment>/<run>/rollouts/``)::

    manifest.json          format, model identity (model.path and a digest of its files), batch shape, seed
    step_000001.parquet    one row per sequence of step 1 (prompts x n), after reward and dynamic sampling

A step file holds every tensor of the batch as a fixed-size list column (its per-row shape and dtype in the
file's ``rlhf`` metadata), every non-tensor column JSON-encoded (``nt/<key>``), the reward extras
(``extra/<key>``) and ``policy_version``: the number of actor updates behind the weights that generated the row.
Notation: B = rows of a step.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_ops.config.errors import ConfigError, ConfigProblem
from rlhf_ops.config.reproducibility_rules import (
    DUMP_FORMAT,
    MANIFEST,
    dump_shape,
    read_dump_manifest,
    step_file,
)
from rlhf_ops.config.schema import RunConfig
from rlhf_ops.protocol import DataProto

log = logging.getLogger(__name__)

DUMP_DIR = "rollouts"
_BF16 = "bfloat16"  # numpy has none: stored as float32 (exact) and cast back
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt")


def model_fingerprint(model_dir: str) -> str:
    """sha256 over the model folder's config, tokenizer and weight files (names and bytes), in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def batch_to_table(batch: DataProto, *, extra: dict[str, list[float]], policy_version: int) -> Any:
    """The Parquet table of one step's batch (see the module docstring)."""
    import pyarrow as pa

    rows = len(batch)
    columns: dict[str, Any] = {}
    tensors: dict[str, dict[str, Any]] = {}
    for key in map(str, batch.tensors.keys()):
        tensor: torch.Tensor = batch.tensors[key]
        dtype = str(tensor.dtype).removeprefix("torch.")
        flat = tensor.detach().cpu().reshape(rows, -1)
        array = (flat.float() if dtype == _BF16 else flat).numpy().reshape(-1)
        width = flat.shape[1]
        columns[key] = pa.FixedSizeListArray.from_arrays(pa.array(array), width)
        tensors[key] = {"dtype": dtype, "shape": list(tensor.shape[1:])}
    for key, column in batch.non_tensor_batch.items():
        columns[f"nt/{key}"] = pa.array([json.dumps(v, default=_json_default) for v in column])
    for key, values in extra.items():
        if len(values) == rows:  # extras of the rows before dynamic sampling do not line up: left out
            columns[f"extra/{key}"] = pa.array([float(v) for v in values], pa.float64())
    columns["policy_version"] = pa.array([policy_version] * rows, pa.int64())
    meta = {"tensors": tensors, "policy_version": policy_version}
    try:
        meta["meta_info"] = json.loads(json.dumps(dict(batch.meta_info)))
    except TypeError:
        meta["meta_info"] = {}
    return pa.table(columns).replace_schema_metadata({"rlhf": json.dumps(meta)})


def table_to_batch(table: Any) -> tuple[DataProto, dict[str, list[float]], int]:
    """The batch, reward extras and policy version of one step's table (inverse of :func:`batch_to_table`)."""
    meta = json.loads(table.schema.metadata[b"rlhf"])
    rows = table.num_rows
    tensors = {}
    for key, spec in meta["tensors"].items():
        values = table.column(key).combine_chunks().flatten().to_numpy(zero_copy_only=False)
        tensor = torch.from_numpy(np.array(values)).reshape(rows, *spec["shape"])
        tensors[key] = tensor.to(getattr(torch, spec["dtype"]))
    non_tensors = {}
    extra = {}
    for name in table.column_names:
        if name.startswith("nt/"):
            column = np.empty(rows, dtype=object)
            column[:] = [json.loads(v) for v in table.column(name).to_pylist()]
            non_tensors[name.removeprefix("nt/")] = column
        elif name.startswith("extra/"):
            extra[name.removeprefix("extra/")] = [float(v) for v in table.column(name).to_pylist()]
    batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta.get("meta_info") or {})
    return batch, extra, int(meta["policy_version"])


def run_dir_of(config: RunConfig) -> Path:
    t = config.trainer
    return Path(t.checkpoint_root) / t.experiment_name / t.run_name


class RolloutRecorder:
    """Writes each step's batch under ``<run folder>/rollouts/`` and copies it to the remote store."""

    def __init__(self, config: RunConfig, *, model_dir: str, total_steps: int) -> None:
        self.dir = run_dir_of(config) / DUMP_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        t = config.trainer
        self.remote = None
        if t.remote_store_url:
            self.remote = "/".join([t.remote_store_url.rstrip("/"), t.experiment_name, t.run_name, DUMP_DIR])
        manifest = {
            "format": DUMP_FORMAT,
            "model": {"path": config.model.path, "fingerprint": model_fingerprint(model_dir)},
            **dump_shape(config),
            "total_steps": total_steps,
        }
        self._write(MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())

    def dump(self, step: int, batch: DataProto, *, extra: dict[str, list[float]], metrics: dict[str, float]) -> None:
        """Writes step ``step``'s batch; its policy version is ``step - 1`` less the pipeline's lag."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        version = step - 1 - int(metrics.get("training/policy_lag", 0))
        table = batch_to_table(batch, extra=extra, policy_version=version)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        self._write(step_file(step), sink.getvalue().to_pybytes())

    def _write(self, name: str, data: bytes) -> None:
        tmp = self.dir / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.dir / name)  # a reader never sees half a file
        if self.remote is not None:
            from rlhf_ops.storage import open_store

            fs, root = open_store(self.remote)
            fs.pipe_file(f"{root}/{name}", data)


class RolloutReplay:
    """The dumped batches of ``trainer.replay_rollouts``, one per step, checked against this run's model."""

    def __init__(self, url: str, *, model_dir: str, total_steps: int) -> None:
        from rlhf_ops.storage import open_store

        self.fs, self.root = open_store(url)
        self.url = url
        manifest = read_dump_manifest(self.fs, self.root)
        fingerprint = model_fingerprint(model_dir)
        if manifest["model"]["fingerprint"] != fingerprint:
            raise ConfigError(
                [
                    ConfigProblem(
                        "trainer.replay_rollouts",
                        f"{url} was dumped from other weights than model.path's ({manifest['model']['path']}, "
                        f"digest {manifest['model']['fingerprint'][:12]} here {fingerprint[:12]})",
                        "set model.path to the dumped run's model, or replay a dump of this model",
                    )
                ]
            )
        missing = [s for s in range(1, total_steps + 1) if not self.fs.exists(f"{self.root}/{step_file(s)}")]
        if missing:
            raise ConfigError(
                [
                    ConfigProblem(
                        "trainer.replay_rollouts",
                        f"{url} holds no batch for step(s) {missing[:5]} of this run's {total_steps}",
                        f"set trainer.total_training_steps={min(missing) - 1} or replay a complete dump",
                    )
                ]
            )

    def batch(self, step: int, metrics: dict[str, float]) -> DataProto:
        """Step ``step``'s batch (scored, balanced and filtered as dumped); adds its ``train/*`` reward metrics."""
        import pyarrow.parquet as pq

        from rlhf_ops.trainer.metrics import compute_reward_metrics_by_source

        with self.fs.open(f"{self.root}/{step_file(step)}", "rb") as f:
            batch, extra, _ = table_to_batch(pq.read_table(f))
        scores, sources = batch.tensors["token_level_scores"].sum(-1), list(batch.non_tensor_batch["data_source"])
        metrics.update(compute_reward_metrics_by_source(scores, sources, prefix="train", extra=extra))
        return batch


def replay_config(config: RunConfig) -> RunConfig:
    """A replay builds no rollout engine: the actor's workers get the HF engine (which holds nothing of its own,
    and is never called: validation is skipped too)."""
    if config.trainer.replay_rollouts is None:
        return config
    rollout = config.rollout.model_copy(update={"engine": "hf", "mode": "sync"})
    return config.model_copy(update={"rollout": rollout})


def attach(trainer: Any, config: RunConfig, *, model_dir: str) -> None:
    """Gives ``trainer`` its recorder (``trainer.dump_rollouts``) and replay source (``trainer.replay_rollouts``)."""
    t = config.trainer
    if t.replay_rollouts is not None:
        trainer.replay = RolloutReplay(t.replay_rollouts, model_dir=model_dir, total_steps=trainer.total_steps)
    if t.dump_rollouts:
        trainer.recorder = RolloutRecorder(config, model_dir=model_dir, total_steps=trainer.total_steps)
