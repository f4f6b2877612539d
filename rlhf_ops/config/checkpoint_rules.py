"""Cross-field rules of checkpoints without a shared filesystem (``trainer.shared_checkpoint_root=false``),
called by :mod:`rlhf_ops.config.validate`.

Without a shared filesystem the driver never sees a rank's shards: they go from each rank's own node to the remote
store (``rlhf_ops.checkpoint.node_local``). So the store is required, and what reads shards on the driver (the HF
export at save time, a resume from a local path) cannot work.
"""

from __future__ import annotations

from rlhf_ops.config.errors import ConfigProblem
from rlhf_ops.config.schema import TrainerConfig


def _is_local_path(resume_mode: str) -> bool:
    return resume_mode not in ("auto", "disable") and ("://" not in resume_mode or resume_mode.startswith("file://"))


def checkpoint_problems(trainer: TrainerConfig) -> list[ConfigProblem]:
    """Problems of ``shared_checkpoint_root`` / ``node_checkpoint_root`` with the other ``trainer`` keys."""
    if trainer.shared_checkpoint_root:
        if trainer.node_checkpoint_root is None:
            return []
        return [
            ConfigProblem(
                "trainer.node_checkpoint_root",
                "is only used with trainer.shared_checkpoint_root=false (every rank writes into checkpoint_root)",
                "unset it, or set trainer.shared_checkpoint_root=false",
            )
        ]
    problems = []
    if trainer.remote_store_url is None:
        problems.append(
            ConfigProblem(
                "trainer.shared_checkpoint_root",
                "false keeps each rank's shards on its own node until it uploads them, so checkpoints exist only on "
                "the remote store, but trainer.remote_store_url is not set",
                "set trainer.remote_store_url (s3://bucket/prefix, webhdfs://namenode:9870/path), or keep "
                "trainer.shared_checkpoint_root=true on a shared filesystem",
            )
        )
    if trainer.save_hf_model:
        problems.append(
            ConfigProblem(
                "trainer.save_hf_model",
                "the export at each save reads every rank's shards on the driver, which has none with "
                "trainer.shared_checkpoint_root=false",
                "set trainer.save_hf_model=false and export from the store (the pipeline's evaluation does), or "
                "trainer.shared_checkpoint_root=true",
            )
        )
    if _is_local_path(trainer.resume_mode):
        problems.append(
            ConfigProblem(
                "trainer.resume_mode",
                f"{trainer.resume_mode!r} is a path on the driver's disk; with trainer.shared_checkpoint_root=false "
                "the ranks of other nodes cannot read it",
                "give the checkpoint's remote URL (s3://.../global_step_<N>), or 'auto'",
            )
        )
    return problems
