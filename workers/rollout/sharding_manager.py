"""Moves the trainer's (FSDP2-sharded) policy weights into a rollout engine: gather → load → free.

verl's ``FSDPVLLMShardingManager``, for FSDP2 and any :class:`~workers.rollout.base.RolloutEngine`::

    manager = FSDPShardingManager(actor_module, engine, bucket_bytes=256 << 20, device="cuda")
    with manager:  # wake the engine, sync the weights if they changed
        batch = engine.generate_sequences(prompts, sampling, step)
    # on exit the engine releases its memory (KV cache and weights: GPU sleep, or the CPU twin) for training
    ...  # the actor's update
    manager.mark_dirty()  # the next rollout syncs the new weights

Gathering: each parameter is a DTensor sharded over the FSDP mesh; ``full_tensor()`` all-gathers it, a
collective, so every rank iterates the same names in the same order and must enter the manager together
(and agree on whether the weights are dirty). Parameters are gathered in buckets of at most
``bucket_bytes`` (or one parameter when it alone is larger), handed to the engine one bucket at a time,
and dropped before the next bucket is gathered: the extra memory on the trainer side is one bucket, never
the whole model. A plain module (no FSDP) works too: its tensors are already full.

Names: the engine receives HF names. A PEFT model's ``base_model.model.`` prefix is stripped, each LoRA
layer is sent merged (``W + scaling * B @ A``, computed in float32, the adapters themselves are not sent),
``modules_to_save`` copies replace their originals, a tied parameter goes out under every name it has
(see :meth:`FSDPShardingManager._build_plan`); then ``name_map`` (if given) maps every remaining
name, for models whose engine names differ from HF's (return the engine's name for an HF name).

Adapter-only sync (``lora_sync="adapter"``, an engine with ``update_adapter`` such as vLLM started with
``lora_rank``): the engine keeps its own base weights (loaded from the model folder; frozen under LoRA, so equal
to the actor's) and each sync gathers the LoRA factors alone, under PEFT's saved names
(``base_model.model.<layer>.lora_A.weight``), with the adapter's PEFT config: ``weight_sync/bytes`` is then
the adapter's size. A trainable parameter that is not a LoRA factor would never reach the engine: refused.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch import Tensor, nn

from workers.rollout.base import RolloutEngine

__all__ = ["FSDPShardingManager"]

_PEFT_PREFIX = "base_model.model."
_LORA_ADAPTER = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")
_ADAPTER_FACTOR = re.compile(r"\.(lora_A|lora_B)\.([^.]+)\.weight$")


@dataclass(frozen=True)
class _SyncItem:
    """One tensor the engine receives: ``source`` gathered, plus LoRA factors (A, B, scaling) to merge."""

    out_name: str
    source: str
    lora: tuple[tuple[str, str, float], ...] = ()


def _gather(param: Tensor, device: torch.device) -> Tensor:
    """The full tensor of ``param`` (all-gathered if it is a DTensor) on ``device``, detached."""
    from torch.distributed.tensor import DTensor

    tensor: Tensor = param.detach()
    if isinstance(tensor, DTensor):
        shard: DTensor = tensor
        if shard.device.type != shard.device_mesh.device_type:  # CPU-offloaded shards: gather on the mesh device
            shard = shard.to(shard.device_mesh.device_type)  # type: ignore[assignment]
        tensor = shard.full_tensor()  # all-gather over the FSDP mesh: every rank must call it
    return tensor.to(device)


def _nbytes(param: Tensor) -> int:
    return param.numel() * param.element_size()  # a DTensor reports its global numel: the gathered size


class FSDPShardingManager:
    """Context manager that syncs ``module``'s weights into ``engine`` on entry and releases it on exit.

    Args:
        module: The trainer's policy (FSDP2-wrapped or plain; HF or PEFT model).
        engine: The rollout engine (``update_weights`` / ``release`` / ``resume``).
        bucket_bytes: Max bytes of full tensors gathered at once (e.g. ``rollout.weight_sync_bucket_mb << 20``).
        name_map: Maps an HF name to the engine's name (applied after PEFT names are resolved); None keeps it.
        device: Where gathered tensors go (the engine's device: ``"cuda"`` for vLLM on GPU).
        dtype: Cast gathered tensors to this dtype (e.g. bf16 for a bf16 engine and fp32 master weights);
            None keeps the parameter dtype (the engine casts on load).
        lora_sync: ``"merged"``: every weight, LoRA folded in (``update_weights``); ``"adapter"``: the LoRA
            factors of the default adapter alone (``update_adapter``; a PEFT model whose only trainable
            parameters are LoRA factors, and an engine serving adapters).

    Attributes:
        last_metrics: Of the last entry: ``timing_s/update_weights``, ``weight_sync/bytes`` (bytes of full
            tensors handed to the engine), ``weight_sync/max_bucket_bytes``, ``weight_sync/num_buckets``,
            ``weight_sync/num_tensors``, ``weight_sync/skipped`` (1.0 when the weights had not changed).

    Raises:
        ValueError: if ``bucket_bytes`` < 1, or a PEFT model uses an adapter type that cannot be merged here, or
            ``lora_sync="adapter"`` for a model or engine without LoRA adapters.
    """

    def __init__(
        self,
        module: nn.Module,
        engine: RolloutEngine,
        *,
        bucket_bytes: int,
        name_map: Callable[[str], str] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        lora_sync: Literal["merged", "adapter"] = "merged",
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1 (rollout.weight_sync_bucket_mb > 0).")
        self.module = module
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.name_map = name_map
        self.device = torch.device(device)
        self.dtype = dtype
        self.last_metrics: dict[str, float] = {}
        self._dirty = True  # the engine's weights may differ (loaded from disk, or dummy) until the first sync
        self.lora_sync = lora_sync
        self._adapter_plan: list[tuple[str, str]] = []  # (PEFT saved name, parameter name)
        self._adapter_config: dict[str, Any] = {}
        if lora_sync == "adapter":
            self._adapter_plan, self._adapter_config = self._build_adapter_plan()
        self._plan = self._build_plan()

    # ------------------------------------------------------------------------------------------- public
    def mark_dirty(self) -> None:
        """Records that the module changed (call after each optimizer step): the next entry syncs."""
        self._dirty = True

    def __enter__(self) -> FSDPShardingManager:
        self.engine.resume()
        stats = {"bytes": 0, "max_bucket": 0, "buckets": 0, "tensors": 0}
        start = time.perf_counter()
        # An engine that discarded its weights on release (vLLM on CPU with free_cache_engine) needs them again.
        self._dirty = self._dirty or self.engine.weights_released
        if self._dirty:
            try:
                if self.lora_sync == "adapter":
                    self._send_adapter(stats)
                else:
                    self.engine.update_weights(self._stream(stats))
            except BaseException:
                self.engine.release()  # __exit__ does not run when __enter__ raises
                raise
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()  # the gathered buckets' blocks, before generation allocates
        self.last_metrics = {
            "timing_s/update_weights": time.perf_counter() - start if self._dirty else 0.0,
            "weight_sync/bytes": float(stats["bytes"]),
            "weight_sync/max_bucket_bytes": float(stats["max_bucket"]),
            "weight_sync/num_buckets": float(stats["buckets"]),
            "weight_sync/num_tensors": float(stats["tensors"]),
            "weight_sync/skipped": 0.0 if self._dirty else 1.0,
        }
        self._dirty = False
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.engine.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def iter_full_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(engine name, full tensor) for the whole model, bucket by bucket; a collective on every rank."""
        return self._stream({"bytes": 0, "max_bucket": 0, "buckets": 0, "tensors": 0})

    # ------------------------------------------------------------------------------------------- internals
    def _build_adapter_plan(self) -> tuple[list[tuple[str, str]], dict[str, Any]]:
        """(PEFT saved name, parameter name) of every factor of the default adapter, and its PEFT config."""
        if not callable(getattr(self.engine, "update_adapter", None)):
            raise ValueError(
                f"lora_sync='adapter' needs an engine that serves LoRA adapters ({type(self.engine).__name__} has "
                "no update_adapter); set rollout.lora_sync=merged"
            )
        peft_config = getattr(self.module, "peft_config", None)
        if not isinstance(peft_config, dict) or "default" not in peft_config:
            raise ValueError("lora_sync='adapter' needs a PEFT LoRA model; set model.lora.rank > 0")
        plan = []
        for name, param in self.module.named_parameters():
            factor = _ADAPTER_FACTOR.search(name)
            if factor is not None and factor.group(2) == "default":
                plan.append((name.replace(f".{factor.group(1)}.default.", f".{factor.group(1)}."), name))
            elif param.requires_grad:
                raise ValueError(
                    f"lora_sync='adapter' sends the LoRA factors only, but {name!r} trains too and would never "
                    "reach the engine; set rollout.lora_sync=merged"
                )
        config = peft_config["default"].to_dict()
        for key, value in list(config.items()):
            if isinstance(value, set):  # target_modules is a set once PEFT resolved it
                config[key] = sorted(value)
        return plan, config

    def _send_adapter(self, stats: dict[str, int]) -> None:
        """Gathers the adapter's factors (small: no buckets) and hands them to the engine in one call."""
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            tensors = {out: _gather(params[name], self.device) for out, name in self._adapter_plan}
        if self.dtype is not None:
            tensors = {out: t.to(self.dtype) for out, t in tensors.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        stats.update(bytes=size, max_bucket=size, buckets=1, tensors=len(tensors))
        self.engine.update_adapter(tensors, self._adapter_config)  # type: ignore[attr-defined]

    def _build_plan(self) -> list[_SyncItem]:
        """The tensors to send, in ``named_parameters`` order (identical on every rank).

        A tied parameter (``lm_head.weight`` is ``model.embed_tokens.weight``) is sent under each of its
        names, gathered again from its first name: vLLM's in-place reload rebuilds every layer from the
        tensors that reach it, and a tied head that receives none keeps the CPU GEMM it packed at start-up
        (stale logits after the first update, logged as ``ParallelLMHead: Failed to load weights``). Engines
        that load in place (GPU ``load_weights``) skip the alias themselves.
        """
        first_name: dict[int, str] = {}
        names: list[tuple[str, str]] = []  # (name, name it is gathered from)
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names.append((name, first_name.setdefault(id(param), name)))
        present = set(first_name.values())
        plan = []
        for name, source in names:
            if _LORA_ADAPTER.search(name):
                self._check_lora_param(name)
                continue  # merged into its base layer's weight below
            if ".original_module." in name:
                continue  # PEFT modules_to_save: the trained copy is sent under the original name instead
            plan.append(_SyncItem(self._out_name(name), source, self._lora_factors(source, present)))
        return plan

    def _check_lora_param(self, name: str) -> None:
        kind = _LORA_ADAPTER.search(name)
        if kind is not None and kind.group(1) not in ("A", "B"):
            raise ValueError(
                f"cannot merge PEFT parameter {name!r} (only LoRA on linear layers is merged); use plain LoRA or "
                "merge the adapters yourself and pass name_map."
            )

    def _lora_factors(self, name: str, present: set[str]) -> tuple[tuple[str, str, float], ...]:
        """(A name, B name, scaling) for each active adapter of a LoRA layer's base weight, else ()."""
        if not name.endswith(".base_layer.weight"):
            return ()
        prefix = name.removesuffix(".base_layer.weight")
        layer = self.module.get_submodule(prefix)
        scaling: dict[str, float] = getattr(layer, "scaling", {})
        if getattr(layer, "fan_in_fan_out", False):
            raise ValueError(f"LoRA layer {prefix!r} has fan_in_fan_out=True (Conv1D); merging it is not supported.")
        adapters = getattr(layer, "active_adapters", list(scaling))
        factors = []
        for adapter in adapters:
            a_name, b_name = f"{prefix}.lora_A.{adapter}.weight", f"{prefix}.lora_B.{adapter}.weight"
            if a_name in present and b_name in present:
                factors.append((a_name, b_name, float(scaling[adapter])))
        return tuple(factors)

    def _out_name(self, name: str) -> str:
        out = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        out = _MODULES_TO_SAVE.sub(".", out)
        return self.name_map(out) if self.name_map is not None else out

    @staticmethod
    def _item_bytes(item: _SyncItem, params: Mapping[str, Tensor]) -> int:
        """Bytes of the full tensors gathered for ``item`` (its LoRA factors included)."""
        names = [item.source, *(name for a_name, b_name, _ in item.lora for name in (a_name, b_name))]
        return sum(_nbytes(params[name]) for name in names)

    def _materialise(self, item: _SyncItem, params: Mapping[str, Tensor]) -> Tensor:
        """Gathers one item's full tensor on ``self.device``, LoRA merged, cast to ``self.dtype``."""
        tensor = _gather(params[item.source], self.device)
        for a_name, b_name, scaling in item.lora:
            lora_a, lora_b = _gather(params[a_name], self.device), _gather(params[b_name], self.device)
            delta = lora_b.float() @ lora_a.float()  # (out, r) @ (r, in) -> (out, in), like the base weight
            tensor = (tensor.float() + scaling * delta).to(tensor.dtype)
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def _stream(self, stats: dict[str, int]) -> Iterator[tuple[str, Tensor]]:
        """Yields (name, full tensor), gathering a bucket of at most ``bucket_bytes`` before yielding it."""
        params: dict[str, Tensor] = dict(self.module.named_parameters())
        bucket: list[tuple[str, Tensor]] = []
        size = 0
        with torch.no_grad():
            for item in self._plan:
                item_bytes = self._item_bytes(item, params)
                # Gather (all-gather of FSDP shards, on every rank) until the next tensor would overflow the
                # bucket, then hand the bucket over and drop it: the trainer's extra memory is one bucket, not a
                # full copy of the model, while each collective still moves bucket_bytes rather than one tensor.
                if bucket and size + item_bytes > self.bucket_bytes:
                    yield from self._flush(bucket, size, stats)
                    size = 0
                bucket.append((item.out_name, self._materialise(item, params)))
                size += item_bytes
            if bucket:
                yield from self._flush(bucket, size, stats)

    @staticmethod
    def _flush(bucket: list[tuple[str, Tensor]], size: int, stats: dict[str, int]) -> Iterator[tuple[str, Tensor]]:
        """Yields the bucket's tensors and empties it, so no reference outlives the bucket on this side."""
        stats["buckets"] += 1
        stats["max_bucket"] = max(stats["max_bucket"], size)
        bucket.reverse()
        while bucket:
            name, tensor = bucket.pop()
            stats["bytes"] += tensor.numel() * tensor.element_size()
            stats["tensors"] += 1
            yield name, tensor
