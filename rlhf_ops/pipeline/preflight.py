"""The ``preflight`` task: resolve and validate the run's config, check what it needs is reachable, plan it.

Nothing is submitted to the cluster before this passes: a bad value fails here with the config's own
message (one line per problem, naming the key and the fix), and so does a model folder, a prepared data file
or a remote store that the run could not use. The result (an XCom) holds the resolved config, the training
job's entrypoint and the global steps at which checkpoints will be committed, which the evaluation tasks
are mapped over.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhf_ops.config import RunConfig, load_config
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.params import PipelineParams, param_overrides, run_overrides, train_entrypoint

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class PreflightError(ValueError):
    """Something the run needs is missing or unreachable; one line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("preflight failed:\n" + "\n".join(f"  - {p}" for p in self.problems))


def plan_checkpoints(config: RunConfig, *, num_train: int) -> tuple[int, list[int]]:
    """``(total steps, steps with a checkpoint)``, by the trainer's rule (every ``save_freq`` steps and the last).

    ``num_train`` is the prepared training set's row count; the loader drops the last partial batch.

    Raises:
        ValueError: fewer training rows than one batch.
    """
    steps_per_epoch = num_train // config.data.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"data.train_batch_size={config.data.train_batch_size} is larger than the {num_train} prepared training "
            "rows; lower data.train_batch_size or add data"
        )
    total = config.trainer.total_epochs * steps_per_epoch
    if config.trainer.total_training_steps is not None:
        total = min(total, config.trainer.total_training_steps)
    freq = config.trainer.save_freq
    steps = {s for s in range(1, total + 1) if freq and s % freq == 0} | {total}
    return total, sorted(steps)


def _check_model(config: RunConfig) -> list[str]:
    problems = []
    for key, path in (("model.path", config.model.path), ("model.tokenizer_path", config.model.tokenizer_path)):
        if path is None or path.startswith(BUILTIN_PREFIX):
            continue  # built-in models are built where they are used
        folder = Path(path)
        if not folder.is_dir():
            problems.append(f"{key}: {path} is not a folder visible here; put the HF model on the shared path")
        elif key == "model.path" and not (folder / "config.json").is_file():
            problems.append(f"{key}: {path} has no config.json; point it at an HF model folder")
        elif key == "model.tokenizer_path" or config.model.tokenizer_path is None:
            if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
                problems.append(f"{key}: {path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    return problems


def _check_data(prepared: Mapping[str, Any]) -> list[str]:
    from rlhf_ops.storage import open_store

    problems = []
    if int(prepared.get("num_train", 0)) <= 0:
        problems.append("data: the prepared training set is empty; check dataset_url and field_map")
    for key in ("train_url", "val_url", "manifest_url"):
        url = prepared.get(key)
        if not url:
            continue
        try:
            fs, path = open_store(str(url))
            if not fs.exists(path):
                problems.append(f"data: {key} {url} does not exist; re-run prepare_data")
        except (OSError, ValueError) as exc:
            problems.append(f"data: cannot read {url}: {exc}")
    return problems


def check_remote_store(url: str, *, probe_dir: str) -> list[str]:
    """Write and delete a small file under ``probe_dir`` (a URL under the store) to prove write access."""
    from rlhf_ops.storage import open_store, redact_url

    probe = f"{probe_dir.rstrip('/')}/.preflight-{uuid.uuid4().hex[:8]}"
    try:
        fs, path = open_store(probe)
        fs.pipe_file(path, b"ok\n")
        fs.rm_file(path)
    except Exception as exc:  # any store error: wrong endpoint, credentials, bucket, permissions
        return [f"trainer.remote_store_url: cannot write to {redact_url(url)} ({type(exc).__name__}: {exc})"]
    return []


def _check_local_root(root: str) -> None:
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # production Airflow workers may mount it read-only: the Ray job writes it
        log.warning("trainer.checkpoint_root %s is not writable from this worker (%s)", root, exc)


def resolve_run_config(
    params: PipelineParams, layout: RunLayout, prepared: Mapping[str, Any], *, model_path: str | None = None
) -> tuple[RunConfig, list[str]]:
    """The validated config and the overrides that produce it from the preset.

    Raises:
        ConfigError: a value is invalid (its message names each key and the fix).
    """
    val_url = prepared.get("val_url") if int(prepared.get("num_val", 0)) else None  # empty val.parquet: no val
    overrides = [
        *param_overrides(params),
        *params.overrides,
        *run_overrides(layout, train_url=prepared["train_url"], val_url=val_url, model_path=model_path),
    ]
    return load_config(params.preset, overrides), overrides


def run_preflight(
    params: PipelineParams, layout: RunLayout, prepared: Mapping[str, Any], *, model_path: str | None = None
) -> dict[str, Any]:
    """Resolve, validate, check and plan the run.

    Args:
        params: The run's parameters.
        layout: Where the run keeps its files.
        prepared: ``prepare_data``'s result (``PrepareResult`` as a dict).
        model_path: The warm-start model folder, when the run starts from the champion.

    Returns:
        ``{"config": resolved config (JSON), "overrides", "entrypoint", "total_steps", "checkpoint_steps",
        "layout", "checkpoint_url", "registered_model_name"}``.

    Raises:
        ConfigError: an invalid value. PreflightError: something unreachable. ValueError: too little data.
    """
    config, overrides = resolve_run_config(params, layout, prepared, model_path=model_path)
    problems = _check_model(config) + _check_data(prepared)
    if layout.remote_run_url:
        problems += check_remote_store(str(config.trainer.remote_store_url), probe_dir=layout.remote_run_url)
    if problems:
        raise PreflightError(problems)
    _check_local_root(layout.checkpoint_root)
    total, steps = plan_checkpoints(config, num_train=int(prepared["num_train"]))
    log.info("preflight ok: %d steps, checkpoints at %s, run folder %s", total, steps, layout.local_run_dir)
    return {
        "config": json.loads(config.model_dump_json()),
        "overrides": overrides,
        "entrypoint": train_entrypoint(params.preset, overrides),
        "total_steps": total,
        "checkpoint_steps": steps,
        "layout": layout.to_dict(),
        "checkpoint_url": layout.checkpoint_url,
        "registered_model_name": params.registered_name(layout.dag_id),
    }
