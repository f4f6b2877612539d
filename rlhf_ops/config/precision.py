"""Which dtype each FSDP role stores, computes and reduces in, and by which mechanism.

One rule for every role, resolved once from ``model.dtype`` and the role's ``fsdp`` section:

- **master** (the sharded weights the optimizer steps, and AdamW's moments): ``float32`` for trained roles
  (actor, critic) unless ``fsdp.master_dtype`` forces otherwise (a warning: an AdamW step of ``lr`` 1e-6
  moves a weight of magnitude 0.02 by 1e-6, below half of bf16's spacing there, 6.1e-5, so it rounds away).
  The reference and the reward model have no optimizer: on GPU they are stored in the compute dtype (half
  the memory, and the same bf16 values the actor computes with at step 0); on CPU in fp32 (memory is not
  scarce there and the autocast path then gives the actor's log-probs bit for bit at step 0).
- **compute**: ``fsdp.mixed_precision.param_dtype``, else ``model.dtype``.
- **reduce**: ``fsdp.mixed_precision.reduce_dtype`` (fp32 by default).
- **mechanism** when compute differs from master: ``"fsdp2"`` on GPU (``MixedPrecisionPolicy``: params
  all-gathered in the compute dtype, gradients reduce-scattered in the reduce dtype, fp32 shards kept), and
  ``"autocast"`` on CPU (``torch.autocast("cpu")`` around each forward: matmuls in bf16, norms, softmax and
  the residual stream in fp32, gathered params stay fp32). FSDP2's policy also runs on a CPU/gloo mesh in
  torch 2.13 (it casts every op to bf16, not only the matmuls); autocast is the CPU mechanism because it
  leaves the numerically sensitive ops in fp32. ``"none"`` when compute equals master.

Log-softmax, KL and losses always run in fp32 on the forward's fp32-cast logits, whatever the mechanism.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from rlhf_ops.config.schema import DType, FSDPConfig

__all__ = ["Mechanism", "RolePrecision", "mechanism_for", "resolve_precision"]

Mechanism = Literal["none", "fsdp2", "autocast"]
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RolePrecision:
    """The resolved precision of one role (dtype names as in the config: ``"float32"``, ``"bfloat16"``)."""

    master: DType
    """Dtype the weights are loaded and stored in (and the optimizer state, for trained roles)."""
    compute: DType
    """Dtype of the forward / backward matmuls."""
    reduce: DType
    """Dtype of the gradient reduction."""
    mechanism: Mechanism
    """How compute is reached from master: FSDP2 policy (GPU), CPU autocast, or nothing to do."""


def resolve_precision(
    model_dtype: DType, fsdp: FSDPConfig, *, trained: bool, device: Literal["cpu", "cuda"] | str, role: str = "actor"
) -> RolePrecision:
    """Resolves one role's precision (see the module docstring for the rules).

    Args:
        model_dtype: ``model.dtype`` (the run's compute dtype).
        fsdp: The role's ``fsdp`` section.
        trained: The role has an optimizer (actor, critic): its master weights default to fp32.
        device: ``"cpu"`` or ``"cuda"`` (``resources.device``).
        role: Config section name, for the warning (``actor``, ``critic``, ``ref``).

    Returns:
        The role's :class:`RolePrecision`. Logs a warning when a trained role's master dtype is forced below fp32.
    """
    compute: DType = fsdp.mixed_precision.param_dtype or model_dtype
    on_gpu = device == "cuda"
    if fsdp.master_dtype is not None:
        master: DType = fsdp.master_dtype
    elif trained:
        master = "float32"
    else:
        master = compute if on_gpu else "float32"
    if trained and master != "float32":
        _LOG.warning(
            "%s.fsdp.master_dtype=%s: the optimizer steps %s weights and keeps its state in %s; AdamW updates "
            "below the dtype's spacing (lr 1e-6 on bf16 weights) round to zero. Unset it for fp32 master weights.",
            role,
            master,
            master,
            master,
        )
    mechanism = mechanism_for(master, compute, device=device)
    return RolePrecision(master=master, compute=compute, reduce=fsdp.mixed_precision.reduce_dtype, mechanism=mechanism)


def mechanism_for(master: DType, compute: DType, *, device: Literal["cpu", "cuda"] | str) -> Mechanism:
    """``"none"`` when ``compute == master``; else ``"autocast"`` on CPU lowering fp32, else ``"fsdp2"``."""
    if compute == master:
        return "none"
    # Autocast only lowers precision (fp32 master -> bf16/fp16 matmuls); any other pair is a plain cast of the
    # gathered params, which FSDP2's policy does on either device.
    return "autocast" if device != "cuda" and master == "float32" else "fsdp2"
