"""Pre-flight rules of ``trainer.deterministic``, ``trainer.replay_rollouts`` and ``trainer.early_stop``
(:mod:`rlhf_ops.config.reproducibility`), called by :mod:`rlhf_ops.config.validate`; and the few facts of a
rollout dump's layout that pre-flight reads (the writer: :mod:`rlhf_ops.trainer.rollout_dump`). Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from rlhf_ops.config.errors import ConfigProblem, shown_value
from rlhf_ops.config.schema import RunConfig

DUMP_FORMAT = 1
MANIFEST = "manifest.json"


def step_file(step: int) -> str:
    return f"step_{step:06d}.parquet"


def dump_shape(run: RunConfig) -> dict[str, Any]:
    """What a dump's batches were shaped by; a replay with other values would train on other batches."""
    return {"data.train_batch_size": run.data.train_batch_size, "rollout.n": run.rollout.n, "seed": run.trainer.seed}


def read_dump_manifest(fs: Any, root: str) -> dict[str, Any]:
    """The dump's manifest. Raises ValueError with a one-line reason when there is none or it is not ours."""
    if not fs.isdir(root):
        raise ValueError("is not a folder")
    try:
        with fs.open(f"{root}/{MANIFEST}", "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise ValueError(f"holds no {MANIFEST}: not the rollouts/ folder of a trainer.dump_rollouts run") from None
    except ValueError:
        raise ValueError(f"its {MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != DUMP_FORMAT:
        raise ValueError(f"its {MANIFEST} is not a rollout dump of format {DUMP_FORMAT}")
    return manifest


def _replay_problems(run: RunConfig) -> list[ConfigProblem]:
    key, url = "trainer.replay_rollouts", run.trainer.replay_rollouts
    assert url is not None
    from rlhf_ops.storage import open_store

    try:
        fs, root = open_store(url)
        manifest = read_dump_manifest(fs, root)
    except (OSError, ValueError) as exc:
        fix = "set the rollouts/ folder a trainer.dump_rollouts=true run wrote (<run folder>/rollouts)"
        return [ConfigProblem(key, f"{shown_value(url)} {str(exc) or type(exc).__name__}", fix)]
    problems = []
    dumped_model = manifest["model"]["path"]
    if dumped_model != run.model.path:
        problems.append(
            ConfigProblem(
                key,
                f"{url} was dumped from model {dumped_model}, this run trains {run.model.path}",
                f"set model.path={dumped_model}, or replay a dump of {run.model.path}",
            )
        )
    for name, value in dump_shape(run).items():
        if manifest.get(name) != value:
            problems.append(
                ConfigProblem(key, f"{url} was dumped with {name}={manifest.get(name)}, here {value}", f"set {name}")
            )
    steps = sorted(int(p.rsplit("_", 1)[1].split(".")[0]) for p in fs.glob(f"{root}/step_*.parquet"))
    want = run.trainer.total_training_steps or int(manifest["total_steps"])
    missing = sorted(set(range(1, want + 1)) - set(steps))
    if missing:
        problems.append(
            ConfigProblem(
                key,
                f"{url} is partial: no batch for step(s) {missing[:5]} of the {want} to replay",
                f"set trainer.total_training_steps={missing[0] - 1}, or dump the run again to its end",
            )
            if missing[0] > 1
            else ConfigProblem(key, f"{url} holds no step's batch", "dump a run with trainer.dump_rollouts=true")
        )
    if run.trainer.pipeline != "sync":
        problems.append(
            ConfigProblem("trainer.pipeline", "a replay generates nothing: there is no rollout to overlap", "set sync")
        )
    return problems


def _determinism_problems(run: RunConfig) -> list[ConfigProblem]:
    problems = []
    why = "cannot be deterministic with trainer.deterministic=true"
    if run.rollout.mode == "async" and run.trainer.replay_rollouts is None:
        problems.append(
            ConfigProblem(
                "rollout.mode",
                f"async {why}: the async engine batches requests in the order they arrive",
                "set rollout.mode=sync, or trainer.deterministic=false",
            )
        )
    if run.trainer.pipeline != "sync":
        problems.append(
            ConfigProblem(
                "trainer.pipeline",
                f"{run.trainer.pipeline} {why}: generation races the update",
                "set trainer.pipeline=sync, or trainer.deterministic=false",
            )
        )
    if run.model.attn_implementation == "flash_attention_2":
        problems.append(
            ConfigProblem(
                "model.attn_implementation",
                f"flash_attention_2 {why}: its backward accumulates with atomics",
                "set model.attn_implementation=sdpa (or eager), or trainer.deterministic=false",
            )
        )
    if run.rollout.engine == "sglang":
        problems.append(
            ConfigProblem(
                "rollout.engine",
                f"sglang {why}: its batches are scheduled as requests arrive",
                "set rollout.engine=vllm or hf, or trainer.deterministic=false",
            )
        )
    return problems


def _early_stop_problems(run: RunConfig) -> list[ConfigProblem]:
    cfg, t = run.trainer.early_stop, run.trainer
    if cfg.metric is None:
        if cfg.threshold is not None or cfg.patience is not None:
            return [
                ConfigProblem(
                    "trainer.early_stop.metric",
                    "is null, so threshold / patience are never checked",
                    "set trainer.early_stop.metric, e.g. val/reward/mean",
                )
            ]
        return []
    key = "trainer.early_stop.metric"
    never = f"{cfg.metric} is never logged"
    if not cfg.metric.startswith("val/"):
        return [ConfigProblem(key, f"{never} by validation", "use val/reward/mean or val/<data_source>/<name>")]
    if not run.data.val_files or not t.test_freq:
        return [
            ConfigProblem(
                key,
                f"{never}: validation does not run during training (data.val_files={run.data.val_files}, "
                f"trainer.test_freq={t.test_freq})",
                "set data.val_files and trainer.test_freq>0, or trainer.early_stop.metric=null",
            )
        ]
    if t.replay_rollouts is not None:
        return [ConfigProblem(key, f"{never}: a replay does not validate", "set trainer.early_stop.metric=null")]
    if cfg.threshold is None and cfg.patience is None:
        return [
            ConfigProblem(
                key, "is set but neither threshold nor patience is", "set trainer.early_stop.threshold or .patience"
            )
        ]
    return []


def reproducibility_problems(run: RunConfig) -> list[ConfigProblem]:
    """Cross-field problems of the reproducibility and early-stop keys (empty when consistent)."""
    problems = _early_stop_problems(run)
    if run.trainer.deterministic:
        problems.extend(_determinism_problems(run))
    if run.trainer.replay_rollouts is not None:
        problems.extend(_replay_problems(run))
    return problems
