"""Pre-flight: everything a run needs, checked before any worker starts, one line per problem.

:func:`preflight_problems` is the one check that ``rlhf train``, ``rlhf config show --check`` and the Airflow
``preflight`` task share: model folders, the policy's architecture against the engines
(:mod:`rlhf_ops.pipeline.preflight_models`), tokenizer (pad / eos, a chat template for chat prompts), the reward
function's import and signature, data files and their columns, the remote store, an explicit resume
checkpoint, the MLflow server, and the cost model's predicted memory per rank (``rlhf_ops.cost_check``). Each
problem names the config key and the fix; nothing raises a traceback.

The Airflow task (:func:`run_preflight`) adds what only the pipeline knows: the prepared data's row counts,
and the plan (the resolved config, the training job's entrypoint and the global steps at which checkpoints
will be committed, which the evaluation tasks are mapped over).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhf_ops.config import ConfigError, RunConfig, build_config, load_config, total_training_steps
from rlhf_ops.config.extension_rules import engine_package_problems, extension_problems
from rlhf_ops.cost_check import cost_problems
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.override_policy import OverridePolicy
from rlhf_ops.pipeline.params import PipelineParams, param_overrides, run_overrides, train_entrypoint
from rlhf_ops.pipeline.preflight_checks import (
    Problem,
    check_data_files,
    check_model_dir,
    check_multi_turn,
    check_remote_store,
    check_resume_checkpoint,
    check_reward_fn,
    check_tokenizer,
    check_tracking,
)
from rlhf_ops.pipeline.preflight_models import check_architecture

log = logging.getLogger(__name__)


class PreflightError(ConfigError):
    """Something the run needs is missing, wrong or unreachable; ``problems`` has one entry per problem."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        self.args = (f"preflight found {len(self.problems)} problem(s); nothing was started:\n{lines}",)

    def __str__(self) -> str:
        return str(self.args[0])


def preflight_problems(
    config: RunConfig, *, notes: list[str] | None = None, remote_probe_dir: str | None = None
) -> list[Problem]:
    """Every problem pre-flight finds in ``config`` (empty: the run can start).

    Args:
        config: The resolved, validated config.
        notes: If given, receives one line per thing worth knowing that is not a problem (pad == eos).
        remote_probe_dir: Where to prove write access to ``trainer.remote_store_url``; default: the run's
            folder there (``<remote_store_url>/<experiment_name>/<run_name>``).

    Returns:
        The problems, in config order; each is one line (``key: message. Fix: fix``).
    """
    notes = [] if notes is None else notes
    model, data, trainer = config.model, config.data, config.trainer
    problems = check_model_dir("model.path", model.path)
    tokenizer_key = "model.tokenizer_path" if model.tokenizer_path else "model.path"
    if model.tokenizer_path:
        problems += check_model_dir_exists(tokenizer_key, model.tokenizer_path)
    if config.needs_critic:
        problems += check_model_dir("critic.model_path", config.critic.model_path)
    problems += check_model_dir("reward.model_path", config.reward.model_path)
    truth_key = data.ground_truth_key if config.reward.reward_fn else None  # a reward model needs no truth
    chat = False
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        found, has_chat = check_data_files(key, files, prompt_key=data.prompt_key, ground_truth_key=truth_key)
        problems += found
        chat = chat or has_chat
    # A folder that is not a model at all gets one line (from check_model_dir), not one per missing file.
    if model.tokenizer_path or (Path(model.path) / "config.json").is_file():
        chat_prompts = chat and data.apply_chat_template
        problems += check_tokenizer(
            tokenizer_key, model.tokenizer_path or model.path, chat_prompts=chat_prompts, notes=notes
        )
    problems += check_architecture(config)
    problems += check_reward_fn(config.reward.reward_fn)
    problems += extension_problems(config, strict=True)  # user entries import; engines' packages are installed
    problems += check_multi_turn(config.rollout.multi_turn)
    if trainer.remote_store_url:
        probe = remote_probe_dir or "/".join(
            [trainer.remote_store_url.rstrip("/"), trainer.experiment_name, trainer.run_name]
        )
        problems += check_remote_store("trainer.remote_store_url", trainer.remote_store_url, probe_dir=probe)
    problems += check_resume_checkpoint(trainer.resume_mode)
    if "mlflow" in trainer.logger:
        problems += check_tracking(config.tracking.mlflow_uri)
    problems += cost_problems(config)  # predicted memory against the ranks' (rlhf_ops.cost_model)
    return _dedupe(problems)


def check_model_dir_exists(key: str, path: str) -> list[Problem]:
    """A tokenizer-only folder: it must exist (its files are checked by ``check_tokenizer``)."""
    if path.startswith("builtin:") or Path(path).is_dir():
        return []
    return [Problem(key, f"{path} is not a folder visible here", "put the tokenizer on a path every node can read")]


def _dedupe(problems: list[Problem]) -> list[Problem]:
    # The same file in train and val files, or the same folder as model and critic, is reported once.
    return list(dict.fromkeys(problems))


def raise_if_problems(config: RunConfig, **kwargs: Any) -> list[str]:
    """Runs :func:`preflight_problems`; raises :class:`PreflightError` if any, else returns the notes."""
    notes: list[str] = []
    problems = preflight_problems(config, notes=notes, **kwargs)
    if problems:
        raise PreflightError(problems)
    for note in notes:
        log.info("preflight: %s", note)
    return notes


def checked_config(config: RunConfig) -> RunConfig:
    """``config`` with ``RLHF_RESUME_MODE`` applied (and validated), after pre-flight found nothing wrong.

    The Airflow operator sets ``RLHF_RESUME_MODE=auto`` when it resubmits a failed training job; the training
    entrypoint calls this before it starts torch, Ray or any worker.

    Raises:
        ConfigError: a bad ``RLHF_RESUME_MODE``; ``PreflightError`` (a ConfigError): what pre-flight found.
    """
    resume = os.environ.get("RLHF_RESUME_MODE")
    if resume:
        data = config.model_dump(mode="json")
        data["trainer"]["resume_mode"] = resume
        config = build_config(data)  # validated like any other value
    raise_if_problems(config)
    missing = engine_package_problems(config)  # the job's own check: the engine runs here, not on Airflow's side
    if missing:
        raise PreflightError(missing)
    return config


def print_problems(exc: ConfigError) -> None:
    """One ``error: <key>: <message>. Fix: <fix>`` line per problem on stderr."""
    for problem in exc.problems:
        print(f"error: {problem}", file=sys.stderr)


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
    total = total_training_steps(config.trainer, steps_per_epoch=steps_per_epoch)
    freq = config.trainer.save_freq
    steps = {s for s in range(1, total + 1) if freq and s % freq == 0} | {total}
    return total, sorted(steps)


def _check_prepared(prepared: Mapping[str, Any]) -> list[Problem]:
    from rlhf_ops.storage import open_store

    problems = []
    if int(prepared.get("num_train", 0)) <= 0:
        problems.append(Problem("data", "the prepared training set is empty", "check dataset_url and field_map"))
    url = prepared.get("manifest_url")
    if url:
        try:
            fs, path = open_store(str(url))
            if not fs.exists(path):
                problems.append(Problem("data", f"manifest_url {url} does not exist", "re-run prepare_data"))
        except Exception as exc:  # any store error (botocore's are neither OSError nor ValueError)
            problems.append(Problem("data", f"cannot read {url}: {exc}", "re-run prepare_data"))
    return problems


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
    params: PipelineParams,
    layout: RunLayout,
    prepared: Mapping[str, Any],
    *,
    model_path: str | None = None,
    override_policy: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Resolve, validate, check and plan the run.

    Args:
        params: The run's parameters.
        layout: Where the run keeps its files.
        prepared: ``prepare_data``'s result (``PrepareResult`` as a dict).
        model_path: The warm-start model folder, when the run starts from the champion.
        override_policy: Which keys ``params.overrides`` may set (:class:`OverridePolicy` as a dict, from the
            DAG's spec); None: the default set.

    Returns:
        ``{"config": resolved config (JSON), "overrides", "entrypoint", "total_steps", "checkpoint_steps",
        "layout", "checkpoint_url", "registered_model_name"}``.

    Raises:
        ConfigError: an invalid value; PreflightError (a ConfigError): something missing, wrong or unreachable.
        ValueError: too little data.
    """
    refused = OverridePolicy.from_dict(override_policy).problems(params.overrides)
    if refused:  # before anything is resolved: a refused key is not even validated
        raise PreflightError(refused)
    config, overrides = resolve_run_config(params, layout, prepared, model_path=model_path)
    notes: list[str] = []
    problems = _check_prepared(prepared) + preflight_problems(
        config, notes=notes, remote_probe_dir=layout.remote_run_url
    )
    if problems:
        raise PreflightError(problems)
    for note in notes:
        log.info("preflight: %s", note)
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
