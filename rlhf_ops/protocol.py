"""The batch container passed between the driver and the Ray workers (verl's ``DataProto``).

Notation: B = rows (one per sample; after ``repeat(n)`` one per prompt x sample), P = prompt length,
R = max response length, T = P + R. Prompts are left-padded, responses right-padded. Stages are the
controller's (DESIGN.md): generate, reward, old_log_prob, ref_log_prob, values, advantages,
update_critic, update_actor; "model passes" = old_log_prob, ref_log_prob, values and both updates.

Every standard key (tensors live in ``batch``, per-row Python objects in ``non_tensor_batch``):

===================  ======  =======  =========================================  ===================================
key                  shape   dtype    written by (stage)                         read by (stage)
===================  ======  =======  =========================================  ===================================
prompts              (B, P)  int64    data loader (left-padded)                  generate, reward, sample logging
responses            (B, R)  int64    generate (right-padded)                    reward, model passes, metrics
input_ids            (B, T)  int64    generate (padding.build_full_sequence)     model passes, reward model
attention_mask       (B, T)  int64    data loader (prompt part), generate        model passes, reward model
position_ids         (B, T)  int64    data loader (prompt part), generate        model passes, reward model
response_mask        (B, R)  int64    generate (padding.get_response_mask)       advantages, losses, metrics
rollout_log_probs    (B, R)  float32  generate (optional)                        update_actor (mismatch correction)
old_log_probs        (B, R)  float32  old_log_prob (actor)                       advantages (KL), update_actor
ref_log_prob         (B, R)  float32  ref_log_prob (reference policy)            advantages (KL), update_actor (KL)
values               (B, R)  float32  values (critic, PPO only)                  advantages (GAE), update_critic
rm_scores            (B, R)  float32  reward (reward model, last valid token)    reward (into token_level_scores)
token_level_scores   (B, R)  float32  reward (model and/or rule functions)       advantages, metrics
token_level_rewards  (B, R)  float32  advantages (scores - beta * KL, or scores)  advantage estimator, metrics
advantages           (B, R)  float32  advantages                                 update_actor
returns              (B, R)  float32  advantages                                 update_critic, metrics
entropys             (B, R)  float32  old_log_prob (optional)                    metrics
uid                  (B,)    object   data loader (one str per prompt)           advantages (GRPO / RLOO groups)
data_source          (B,)    object   data loader (str)                          reward (function dispatch), metrics
ground_truth         (B,)    object   data loader (any)                          reward (rule functions)
raw_prompt           (B,)    object   data loader (list of chat messages)        generate (chat template), logging
extra_info           (B,)    object   data loader (dict)                         reward
===================  ======  =======  =========================================  ===================================

Design choices:
- Every method returns a new ``DataProto`` and leaves ``self`` unchanged, except ``pop`` (which
  removes keys from ``self``). Results share tensor storage with ``self`` unless ``select(deepcopy=True)``.
  Write ``data = data.union(other)``: a bare ``data.union(other)`` (verl's in-place habit) does nothing.
- ``meta_info`` is typed by :class:`MetaInfo`; unknown keys (``ValueError``) and wrongly typed values
  (``TypeError``) are rejected whenever a ``DataProto`` is built. Adding a key is one line in MetaInfo.
- Pickling (Ray) copies every tensor that is a view of a larger storage, so a chunk ships only its rows.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Union, cast, get_args, get_origin, get_type_hints, overload

import numpy as np
import torch
from tensordict import TensorDict
from torch import Tensor

__all__ = ["DataProto", "DataProtoItem", "MetaInfo"]

IndexLike = slice | Sequence[int] | Sequence[bool] | np.ndarray | Tensor


class MetaInfo(TypedDict, total=False):
    """Known ``meta_info`` keys: what a worker reports back about a call, batch-wide.

    No control values: a call's settings (sampling, temperature, step, micro-batch sizes) are typed arguments of
    the role methods (``rlhf_ops.trainer.roles``) or come from the ``BatchPlan``; an unknown key is refused.
    """

    metrics: dict[str, Any]  # worker metrics; concat merges them (see DataProto.concat)
    timing: dict[str, float]  # seconds per sub-stage, measured by workers


_META_TYPES: dict[str, Any] = get_type_hints(MetaInfo)


def _conforms(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arg) for arg in get_args(tp))
    if tp is bool:
        return isinstance(value, bool | np.bool_)
    if tp is int:
        return isinstance(value, int | np.integer) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


def _check_meta(meta: Mapping[str, Any]) -> None:
    for key, value in meta.items():
        if key not in _META_TYPES:
            raise ValueError(
                f"meta_info key {key!r} is unknown; known keys: {sorted(_META_TYPES)}. "
                "Add it to MetaInfo in rlhf_ops/protocol.py, or put per-row data in tensors / non_tensors."
            )
        if not _conforms(value, _META_TYPES[key]):
            raise TypeError(f"meta_info[{key!r}] must be {_META_TYPES[key]}, got {type(value).__name__}: {value!r}.")


def _as_meta(meta: Mapping[str, Any] | None) -> MetaInfo:
    return cast(MetaInfo, dict(meta or {}))


def _as_object_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        arr = value if value.dtype == object else value.astype(object)
    elif isinstance(value, list | tuple):
        arr = np.empty(len(value), dtype=object)
        for i, v in enumerate(value):  # element-wise so lists of equal-length lists stay 1-D
            arr[i] = v
    else:
        raise ValueError(f"non_tensor_batch[{key!r}] is a {type(value).__name__}; pass a list or numpy array.")
    if arr.ndim == 0:
        raise ValueError(f"non_tensor_batch[{key!r}] is 0-d; put batch-wide values in meta_info.")
    return arr


def _make_td(tensors: Mapping[str, Tensor], batch_size: int, device: torch.device | None) -> TensorDict:
    return TensorDict(dict(tensors), batch_size=[batch_size], device=device)


def _tensors_of(batch: TensorDict | None) -> dict[str, Tensor]:
    return {cast(str, k): cast(Tensor, v) for k, v in batch.items()} if batch is not None else {}


def _proto(batch: TensorDict | None, columns: dict[str, np.ndarray], meta: Mapping[str, Any]) -> DataProto:
    return DataProto(batch=batch, non_tensor_batch=columns, meta_info=_as_meta(meta))


def _keys(keys: str | Iterable[str] | None, available: Iterable[str], what: str) -> list[str]:
    """Resolves a key selection (None = all) and raises ``KeyError`` naming any missing key."""
    avail = list(available)
    if keys is None:
        return avail
    wanted = [keys] if isinstance(keys, str) else list(keys)
    missing = [k for k in wanted if k not in avail]
    if missing:
        raise KeyError(f"{what} has no key(s) {missing}; available: {avail}.")
    return wanted


def _values_equal(a: Any, b: Any) -> bool:
    """Union equality: NaN-aware torch.equal for tensors, element-wise for arrays, ``==`` otherwise."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.to(a.device)  # NaN == NaN here, so a float tensor unions with itself
        return torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all()))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and all(_values_equal(x, y) for x, y in zip(a.flat, b.flat, strict=True))
    try:
        return a is b or bool(a == b)
    except (ValueError, TypeError, RuntimeError):  # e.g. lists of tensors: ambiguous truth value
        return False


@dataclass(eq=False)
class DataProtoItem:
    """One row of a :class:`DataProto` (``data[i]``): tensors with batch_size [] and scalar columns."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, Any]
    meta_info: MetaInfo


@dataclass(eq=False, repr=False)
class DataProto:
    """B rows: tensors (TensorDict, batch_size [B]), object columns (length B) and typed meta (see module doc).

    Build with :meth:`from_dict`; construction validates. After editing fields by hand: :meth:`check_consistency`.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: MetaInfo = field(default_factory=MetaInfo)

    def __post_init__(self) -> None:
        self.check_consistency()

    def check_consistency(self) -> None:
        """Checks row counts, flat tensors and meta (ValueError / TypeError); makes columns object arrays."""
        rows: int | None = None
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict) or self.batch.batch_dims != 1:
                raise ValueError(f"batch must be a TensorDict with batch_size [B], got {self.batch!r}.")
            rows = self.batch.batch_size[0]
            for key, value in self.batch.items():
                if not isinstance(value, Tensor):
                    raise ValueError(f"batch[{key!r}] is a {type(value).__name__}; only flat tensors are allowed.")
        for key in list(self.non_tensor_batch):
            arr = self.non_tensor_batch[key] = _as_object_array(key, self.non_tensor_batch[key])
            rows = len(arr) if rows is None else rows
            if len(arr) != rows:
                raise ValueError(f"non_tensor_batch[{key!r}] has {len(arr)} rows but the batch has {rows}.")
        _check_meta(self.meta_info)

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, Tensor] | None = None,
        *,
        non_tensors: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> DataProto:
        """Builds a DataProto; B is the first tensor's (else the first column's) length.

        Args:
            tensors: name -> tensor with leading dim B (0-d tensors belong in ``meta_info``).
            non_tensors: name -> list or numpy array of length B (stored as ``dtype=object``).
            meta_info: batch-wide values; keys must be declared in :class:`MetaInfo`.

        Raises:
            ValueError: a tensor or column whose length differs from the first one's (both keys named).
        """
        tensors = dict(tensors or {})
        columns = {k: _as_object_array(k, v) for k, v in (non_tensors or {}).items()}
        ref: tuple[str, int] | None = None
        entries: list[tuple[str, Tensor | np.ndarray]] = [*tensors.items(), *columns.items()]
        for key, value in entries:
            if isinstance(value, Tensor) and value.dim() == 0:
                raise ValueError(f"tensor {key!r} is 0-d; put batch-wide scalars in meta_info.")
            ref = (key, len(value)) if ref is None else ref
            if len(value) != ref[1]:
                raise ValueError(f"{key!r} has {len(value)} rows but {ref[0]!r} has {ref[1]}; they must match.")
        devices = {t.device for t in tensors.values()}
        device = devices.pop() if len(devices) == 1 else None
        batch = _make_td(tensors, ref[1] if ref else 0, device) if tensors else None
        return cls(batch=batch, non_tensor_batch=columns, meta_info=_as_meta(meta_info))

    @property
    def tensors(self) -> TensorDict:
        """``batch`` typed as non-optional (for mypy); ``ValueError`` if this DataProto holds no tensors."""
        if self.batch is None:
            raise ValueError("this DataProto has no tensors (batch is None); build it with from_dict(tensors=...).")
        return self.batch

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        return len(next(iter(self.non_tensor_batch.values()))) if self.non_tensor_batch else 0

    def __repr__(self) -> str:
        tensors = {k: (tuple(v.shape), str(v.dtype)) for k, v in _tensors_of(self.batch).items()}
        columns, meta = list(self.non_tensor_batch), list(self.meta_info)
        return f"DataProto(len={len(self)}, batch={tensors}, non_tensor_batch={columns}, meta_info={meta})"

    def __iter__(self) -> Iterator[DataProtoItem]:
        return (self[i] for i in range(len(self)))

    @overload
    def __getitem__(self, item: int) -> DataProtoItem: ...
    @overload
    def __getitem__(self, item: IndexLike) -> DataProto: ...
    def __getitem__(self, item: int | IndexLike) -> DataProtoItem | DataProto:
        """``data[i]`` -> :class:`DataProtoItem`; slice -> view; int indices or a bool mask -> gathered copy."""
        if isinstance(item, int | np.integer):
            n, i = len(self), int(item)
            if not -n <= i < n:
                raise IndexError(f"row {i} is out of range for a DataProto of {n} rows.")
            batch = self.batch[i] if self.batch is not None else None
            columns = {k: v[i] for k, v in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=columns, meta_info=_as_meta(self.meta_info))
        if isinstance(item, slice):
            batch = self.batch[item] if self.batch is not None else None
            return _proto(batch, {k: v[item] for k, v in self.non_tensor_batch.items()}, self.meta_info)
        return self._take(self._normalize_index(item))

    def _normalize_index(self, item: Any) -> np.ndarray:
        arr = item.detach().cpu().numpy() if isinstance(item, Tensor) else np.asarray(item)
        arr, n = (arr.astype(np.int64) if arr.size == 0 else arr), len(self)
        if arr.ndim != 1 or not (arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer)):
            raise IndexError(f"index must be 1-D integers or bools, got shape {arr.shape} dtype {arr.dtype}.")
        if arr.dtype == np.bool_:
            if len(arr) != n:
                raise IndexError(f"boolean mask has {len(arr)} entries but the DataProto has {n} rows.")
            return np.flatnonzero(arr)
        if arr.size and (arr.min() < -n or arr.max() >= n):
            raise IndexError(f"index {arr.tolist()} is out of range for a DataProto of {n} rows.")
        return np.where(arr < 0, arr + n, arr).astype(np.int64)

    def _take(self, idx: np.ndarray) -> DataProto:
        batch = None
        if self.batch is not None:
            batch = self.batch[torch.from_numpy(idx).to(self.batch.device or "cpu")]
        return _proto(batch, {k: v[idx] for k, v in self.non_tensor_batch.items()}, self.meta_info)

    def select(
        self,
        batch_keys: str | Iterable[str] | None = None,
        *,
        non_tensor_batch_keys: str | Iterable[str] | None = None,
        meta_info_keys: str | Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Returns the listed keys (None = all of a kind), sharing storage unless ``deepcopy``; KeyError if absent."""
        batch = None
        if self.batch is not None:
            batch = self.batch.select(*_keys(batch_keys, _tensors_of(self.batch), "batch"))
        elif batch_keys:
            raise KeyError(f"batch is None; cannot select tensors {batch_keys}.")
        columns = {k: self.non_tensor_batch[k] for k in _keys(non_tensor_batch_keys, self.non_tensor_batch, "columns")}
        all_meta = cast(dict[str, Any], self.meta_info)
        meta = {k: all_meta[k] for k in _keys(meta_info_keys, all_meta, "meta_info")}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            columns, meta = copy.deepcopy(columns), copy.deepcopy(meta)
        return _proto(batch, columns, meta)

    def pop(
        self,
        batch_keys: str | Iterable[str] = (),
        *,
        non_tensor_batch_keys: str | Iterable[str] = (),
        meta_info_keys: str | Iterable[str] = (),
    ) -> DataProto:
        """Removes the keys from ``self`` (the only mutating method), returns them; KeyError (no change) if absent."""
        popped = self.select(batch_keys, non_tensor_batch_keys=non_tensor_batch_keys, meta_info_keys=meta_info_keys)
        if self.batch is not None:
            self.batch = self.batch.exclude(*_keys(batch_keys, _tensors_of(self.batch), "batch"))
        drop = set(_keys(non_tensor_batch_keys, self.non_tensor_batch, "columns"))
        self.non_tensor_batch = {k: v for k, v in self.non_tensor_batch.items() if k not in drop}
        drop = set(_keys(meta_info_keys, self.meta_info, "meta_info"))
        self.meta_info = _as_meta({k: v for k, v in self.meta_info.items() if k not in drop})
        return popped

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Returns a DataProto with tensor and/or column keys renamed (``old_keys[i]`` -> ``new_keys[i]``).

        Raises ``KeyError`` for an absent old key; ``ValueError`` for unequal lists or a name collision.
        """
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old) != len(new) or len(set(new)) != len(new):
            raise ValueError(f"rename needs as many distinct new keys as old keys, got {old} -> {new}.")
        mapping = dict(zip(old, new, strict=True))
        tensors = _tensors_of(self.batch)
        _keys(old, [*tensors, *self.non_tensor_batch], "DataProto")
        renamed: list[dict[str, Any]] = []
        for source in (tensors, self.non_tensor_batch):
            clash = {k for k in source if k not in mapping} & set(new)
            if clash:
                raise ValueError(f"rename target(s) {sorted(clash)} already exist; pop or rename them first.")
            renamed.append({mapping.get(k, k): v for k, v in source.items()})
        batch = _make_td(renamed[0], len(self), self.batch.device) if self.batch is not None else None
        return _proto(batch, renamed[1], self.meta_info)

    def union(self, other: DataProto) -> DataProto:
        """Returns the keys of both; a key present in both must hold equal values.

        A side with neither tensors nor columns (meta only) unions with any length. Raises
        ``ValueError`` for different lengths or for a shared key with different values (named).
        """
        has_rows = [d.batch is not None or bool(d.non_tensor_batch) for d in (self, other)]
        if all(has_rows) and len(self) != len(other):
            raise ValueError(f"union needs equal lengths, got {len(self)} and {len(other)}.")
        parts: list[dict[str, Any]] = []
        sides: list[tuple[str, Mapping[str, Any], Mapping[str, Any]]] = [
            ("batch", _tensors_of(self.batch), _tensors_of(other.batch)),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ]
        for where, mine, theirs in sides:
            merged = dict(mine)
            for key, value in theirs.items():
                if key in merged and not _values_equal(merged[key], value):
                    raise ValueError(f"union conflict on {where}[{key!r}]: both sides hold it with different values.")
                merged[key] = value
            parts.append(merged)
        template = self.batch if self.batch is not None else other.batch
        batch = _make_td(parts[0], template.batch_size[0], template.device) if template is not None else None
        return _proto(batch, parts[1], parts[2])

    def chunk(self, chunks: int) -> list[DataProto]:
        """Splits into ``chunks`` equal views (one per data-parallel rank); ``len`` must divide evenly."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}.")
        if len(self) % chunks:
            raise ValueError(
                f"cannot chunk {len(self)} rows into {chunks} equal parts; pad first: "
                f"padded, pad_size = data.pad_to_divisor({chunks}), then unpad(pad_size) the gathered output."
            )
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Splits into views of ``split_size`` rows; the last may be shorter (none for an empty batch)."""
        if split_size < 1:
            raise ValueError(f"split_size must be >= 1, got {split_size}.")
        return [self[i : i + split_size] for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenates along rows. ``meta_info`` is the first item's, except ``metrics``.

        ``metrics`` merges every item's ``metrics`` into ``{name: [values...]}`` in item order: a list
        value is extended, a scalar appended (verl's list-of-dicts to dict-of-lists), so the driver can
        average per-rank metrics. Raises ``ValueError`` for an empty list or differing key sets.
        """
        if not data:
            raise ValueError("concat needs at least one DataProto.")
        key_sets = [(set(_tensors_of(d.batch)), d.batch is None, set(d.non_tensor_batch)) for d in data]
        for i, keys in enumerate(key_sets):
            if keys != key_sets[0]:
                raise ValueError(f"concat item {i} has keys {keys} but item 0 has {key_sets[0]}; select common keys.")
        first = data[0]
        batch = None
        if first.batch is not None:
            batch = cast(TensorDict, torch.cat([cast(TensorDict, d.batch) for d in data], dim=0))
        columns = {k: np.concatenate([d.non_tensor_batch[k] for d in data], axis=0) for k in first.non_tensor_batch}
        meta: dict[str, Any] = dict(first.meta_info)
        all_metrics = [d.meta_info["metrics"] for d in data if d.meta_info.get("metrics") is not None]
        if all_metrics:
            merged: dict[str, list[Any]] = {}
            for name, value in (item for metrics in all_metrics for item in metrics.items()):
                merged.setdefault(name, []).extend(value if isinstance(value, list) else [value])
            meta["metrics"] = merged
        return _proto(batch, columns, meta)

    def repeat(self, repeat_times: int, *, interleave: bool = True) -> DataProto:
        """Repeats rows: interleave ``[a, a, b, b]`` (n samples per prompt) or tile ``[a, b, a, b]``."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}.")
        rows = np.arange(len(self))
        return self._take(np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times))

    def reorder(self, indices: Sequence[int] | np.ndarray | Tensor) -> DataProto:
        """Returns a new DataProto whose row i is ``self[indices[i]]``; ``indices`` must be a permutation.

        ``self`` is unchanged. To gather arbitrary rows (repeats, subsets) index instead: ``data[indices]``.
        """
        idx = self._normalize_index(indices)
        if len(idx) != len(self) or not np.array_equal(np.sort(idx), np.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}); use data[indices] to gather.")
        return self._take(idx)

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pads to a multiple of ``divisor`` by repeating leading rows (cyclically if more are needed).

        Returns ``(padded, pad_size)``; ``pad_size`` is 0 (``padded`` a shallow copy) if already divisible.
        """
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, got {divisor}.")
        n, pad_size = len(self), (-len(self)) % divisor  # an empty batch needs no padding: -0 % d == 0
        if pad_size == 0:
            return self[:], 0
        return self._take(np.concatenate([np.arange(n), np.arange(pad_size) % n])), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drops the last ``pad_size`` rows (the inverse of :meth:`pad_to_divisor` on outputs)."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size must be in [0, {len(self)}], got {pad_size}.")
        return self[: len(self) - pad_size]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> DataProto:
        """Returns a DataProto with every tensor on ``device`` (columns are shared, not copied)."""
        batch = self.batch.to(device, non_blocking=non_blocking) if self.batch is not None else None
        return _proto(batch, dict(self.non_tensor_batch), self.meta_info)

    def __getstate__(self) -> tuple[Any, ...]:
        """Compact state for Ray: views are copied out of their parent storage and tensors detached."""
        tensors: dict[str, Tensor] | None = None
        if self.batch is not None:
            tensors = {}
            for key, t in _tensors_of(self.batch).items():
                t = t.detach()
                owns = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
                tensors[key] = t if owns and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
        device = self.batch.device if self.batch is not None else None
        return tensors, len(self), device, self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        tensors, rows, device, self.non_tensor_batch, self.meta_info = state
        self.batch = _make_td(tensors, rows, device) if tensors is not None else None
