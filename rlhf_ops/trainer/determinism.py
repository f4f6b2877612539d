"""``trainer.deterministic``: the process-wide settings under which a run repeats bit for bit.

What makes two runs with the same seed differ, and what this module (with the rest of the code) does about it:

- kernels that pick a different reduction order from run to run (CUDA atomics, cuBLAS workspaces, cuDNN
  autotuning): ``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG``, no cuDNN benchmark,
  no TF32;
- the number of threads a reduction is split over (CPU matmuls sum in per-thread blocks): every worker computes
  with ``resources.threads_per_worker`` intra-op threads and one inter-op thread, the driver with one;
- sampling: each training step reseeds the engines from (seed, step) (vLLM: one seed per request), and validation
  from (seed, step + :data:`VALIDATION_STEP_OFFSET`), so a resumed run draws what the uninterrupted run drew;
- the order requests reach an engine (an async engine batches them as they arrive) and pipelining: refused at
  pre-flight (:mod:`rlhf_ops.config.reproducibility_rules`).

The driver applies it before it builds anything; every worker process applies it in its constructor from the
environment variable :data:`ENV_VAR` that the run's worker environment carries.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV_VAR = "RLHF_DETERMINISTIC"
# cuBLAS keeps per-stream workspaces whose reuse order changes results unless their size is fixed (CUDA docs).
CUBLAS_WORKSPACE = ":4096:8"
# Validation engine calls are seeded from this offset plus the global step: apart from every training step's seed.
VALIDATION_STEP_OFFSET = 1_000_000_000


def worker_env(deterministic: bool) -> dict[str, str]:
    """Environment variables every worker process of a deterministic run needs (empty when it is not one)."""
    if not deterministic:
        return {}
    return {ENV_VAR: "1", "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE}


def enabled() -> bool:
    """Whether this process runs under ``trainer.deterministic`` (set by :func:`apply`, or in its environment)."""
    return os.environ.get(ENV_VAR) == "1"


def apply(*, intra_op_threads: int | None = None) -> None:
    """Makes this process's torch deterministic; ``intra_op_threads`` fixes its thread count (None: unchanged).

    Idempotent. Called by the driver (``workers.entrypoints.train``) and by every worker's constructor.
    """
    import torch

    os.environ[ENV_VAR] = "1"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if intra_op_threads is not None:
        torch.set_num_threads(intra_op_threads)
    try:  # only before the first parallel region of the process: a later call raises, and the count stays
        torch.set_num_interop_threads(1)
    except RuntimeError:
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())


def apply_from_env() -> None:
    """:func:`apply` in a worker process whose environment says the run is deterministic; else nothing."""
    if enabled():
        apply()


def validation_step(global_step: int) -> int | None:
    """The ``step`` validation's engine calls are seeded with: None (the engines' running generators) unless the
    run is deterministic, where the draws must not depend on what the process generated before (a resume)."""
    return VALIDATION_STEP_OFFSET + global_step if enabled() else None
