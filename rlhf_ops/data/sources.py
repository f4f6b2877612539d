"""Reading the raw rows of a prepare-data source (:mod:`rlhf_ops.data.prepare`): files, shard folders, HF folders.

A source is a JSONL / Parquet file (optionally compressed), a folder of shards (name order; hidden and
``_``-prefixed paths skipped), a ``Dataset.save_to_disk`` folder, or ``builtin:<toy task>``. Rows come out
in source order as :class:`RawRow`; a line that is not JSON is a row with its :class:`Reject` set, so it
lands in ``rejected.jsonl`` instead of stopping the run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import pyarrow.parquet as pq

from rlhf_ops.data.toy_tasks import make_toy_dataset
from rlhf_ops.storage.stores import open_store
from rlhf_ops.storage.stores import redact_url as _redact

BUILTIN_TOY_ROWS = 512  # rows of a builtin toy source without ``limit`` (DataConfig.toy_rows' default)
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
_HIDDEN = re.compile(r"/[._]")  # a path component that starts with "." or "_"


class Reject(Exception):
    """A rejected row: ``args == (kind, reason)``."""


class RawRow(NamedTuple):
    source: str  # URL of the file (shard) the row came from
    row_index: int  # row index, or JSONL line index, within ``source`` (0-based)
    row: Any  # the parsed row, or the raw line when ``error`` is set
    error: Reject | None = None


def open_fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """(filesystem, path without a trailing ``/``) of ``url``: any installed fsspec protocol, with our stores'
    own options for s3 / hdfs (S3 endpoint/region from the environment, botocore retries)."""
    return open_store(url, storage_options=storage_options)


def _file_kind(path: str) -> str | None:
    name = path.lower()
    name = next((name.removesuffix(c) for c in _COMPRESSIONS if name.endswith(c)), name)
    return next((kind for kind in ("parquet", "jsonl", "json") if name.endswith(f".{kind}")), None)


def _iter_file(fs: Any, path: str, source: str) -> Iterator[RawRow]:
    if _file_kind(path) == "parquet":
        with fs.open(path, "rb") as f:  # to_pylist: plain lists and dicts, no numpy arrays
            rows = (r for batch in pq.ParquetFile(f).iter_batches(batch_size=4096) for r in batch.to_pylist())
            yield from (RawRow(source, i, row) for i, row in enumerate(rows))
        return
    with fs.open(path, "rb", compression="infer") as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    yield RawRow(source, i, json.loads(line.decode("utf-8")))
                except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, [[[...]]] nesting
                    text = line.decode("utf-8", errors="replace").rstrip("\n")
                    yield RawRow(source, i, text, Reject("invalid_json", f"line {i} is not UTF-8 JSON: {exc}"))


def iter_source(
    url: str, *, limit: int | None, seed: int, storage_options: Mapping[str, Any] | None
) -> Iterator[RawRow]:
    """The rows of ``url`` in order (a builtin toy source: ``limit`` rows, or 512, generated with ``seed``)."""
    if url.startswith("builtin:"):
        rows = make_toy_dataset(url.removeprefix("builtin:"), num_rows=limit or BUILTIN_TOY_ROWS, seed=seed)
        yield from (RawRow(url, i, row) for i, row in enumerate(rows))
        return
    fs, path = open_fs(url, storage_options)
    if not fs.exists(path):
        raise ValueError(f"source {_redact(url)!r} does not exist; check the URL and the store's credentials")
    if not fs.isdir(path):
        if _file_kind(path) is None:
            raise ValueError(f"source {_redact(url)!r} must end in .parquet, .jsonl or .json (optionally compressed)")
        yield from _iter_file(fs, path, url)
    elif fs.exists(f"{path}/state.json"):  # Dataset.save_to_disk (for a DatasetDict, point at one split)
        from datasets import load_from_disk

        dataset = load_from_disk(url, storage_options=dict(storage_options) if storage_options else None)
        yield from (RawRow(url, i, dict(row)) for i, row in enumerate(dataset))
    else:  # shards in name order; skips .json files (often metadata) and hidden or _-prefixed paths (partial output)
        rel = {p: p[len(path) :] for p in fs.find(path)}
        shards = sorted(p for p, r in rel.items() if _file_kind(r) in ("parquet", "jsonl") and not _HIDDEN.search(r))
        if not shards:
            raise ValueError(f"source {_redact(url)!r}: no *.parquet / *.jsonl shards, not an HF Dataset folder")
        for shard in shards:
            yield from _iter_file(fs, shard, fs.unstrip_protocol(shard))
