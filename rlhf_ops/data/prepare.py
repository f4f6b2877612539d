"""Dataset preparation (the pipeline's ``prepare_data`` task): raw rows → validated, split, tokenizer-checked files.

Output of one run, under ``<out_url>/<run_id>/``::

    train.parquet, val.parquet  prompt (str or [{role, content}]), ground_truth, data_source, extra_info (JSON
                                str), ability, reward_model ({ground_truth, style}), prompt_num_tokens (int64),
                                and images (list<binary>) for image data
    rejected.jsonl              {"row_index", "source", "kind", "reason", "row" (truncated repr)} per rejected row
    manifest.json               written last (no manifest, no prepared data): spec, counts, reasons, sha256s

verl's Parquet layout is read as is (``prompt`` as chat messages, ``reward_model.ground_truth``,
``data_source``, ``extra_info``, ``ability``) and written back in both layouts: ``ground_truth`` at the top
for our trainer, ``reward_model: {ground_truth, style}`` and ``ability`` for verl's readers.

``prompt_num_tokens`` comes from the trainer's own :func:`rlhf_ops.data.dataset.encode_prompt`, so the
trainer never drops an accepted prompt. The split hashes ``seed`` and the raw prompt (before template and system
prompt), not the row order: re-runs give the same files, appended rows never move old ones, duplicated prompts
never straddle train and val, and a larger ``val_fraction`` only moves rows into val. A retry removes the
manifest, writes whole files (temp name + rename locally, one PUT on object stores), then the manifest; Parquet
files carry no timestamps, so a retry rewrites identical bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlhf_ops.data.field_transforms import (
    FieldSource,
    absent_column_problem,
    parse_field_source,
    transform_row_value,
)
from rlhf_ops.data.row_text import data_source_problem, text_problem
from rlhf_ops.data.sources import RawRow, Reject, iter_source, open_fs
from rlhf_ops.storage.stores import redact_url as _redact

logger = logging.getLogger(__name__)

FIELDS = ("prompt", "ground_truth", "data_source", "extra_info", "ability")
IMAGES_FIELD = "images"  # optional: encoded images, one "<image>" placeholder each (rlhf_ops.data.images)
TRAIN_FILE, VAL_FILE, REJECTED_FILE, MANIFEST_FILE = "train.parquet", "val.parquet", "rejected.jsonl", "manifest.json"
_URLS = {"train_url": TRAIN_FILE, "val_url": VAL_FILE, "rejected_url": REJECTED_FILE, "manifest_url": MANIFEST_FILE}
_VERL_GROUND_TRUTH = "reward_model.ground_truth"
_REPR_LIMIT = 500
_RUN_ID = re.compile(r"[A-Za-z0-9._:+=@-]{1,200}")
_MISSING: Any = object()
Prompt = str | list[dict[str, str]]
Row = dict[str, Any]


class DataQualityError(ValueError):
    """Too many rejected rows (or none left to train on); ``rejected.jsonl`` holds every rejected row."""

    def __init__(self, message: str, *, share: float, threshold: float, reasons: dict[str, int], rejected_url: str):
        super().__init__(message)
        self.share, self.threshold, self.reasons, self.rejected_url = share, threshold, reasons, rejected_url


class PrepareSpec(BaseModel):
    """What to prepare and how. Credentials never go here: pass ``storage_options`` or use the environment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(..., min_length=1, description="JSONL/Parquet file, shard folder, HF folder, builtin:<task>")
    val_source: str | None = Field(default=None, description="Validation rows; when set, val_fraction is ignored.")
    # field_map: our column -> source column or dotted path, then named transforms (rlhf_ops.data.field_transforms);
    # unmapped ground_truth falls back to verl's layout.
    field_map: dict[str, str] = Field(
        default_factory=dict, description="e.g. {'prompt': 'question', 'ground_truth': 'answer|gsm8k_final_answer'}"
    )
    # chat: a text prompt becomes one user message; text: chat rows are rejected; auto: keep each row's form.
    prompt_format: Literal["auto", "text", "chat"] = "auto"
    system_prompt: str | None = Field(default=None, description="System message added to chat prompts without one.")
    prompt_template: str | None = Field(default=None, description="Template with '{prompt}'; chat: last user message")
    apply_chat_template: bool = Field(default=True, description="Tokenize like data.apply_chat_template in training.")
    max_prompt_length: int = Field(..., gt=0, description="Longer prompts (tokens) are rejected.")
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0, description="Share of prompts hashed into val.parquet.")
    seed: int = Field(default=0, description="Seed of the split hash (and of builtin toy rows).")
    max_rejected_fraction: float = Field(default=0.1, ge=0.0, le=1.0, description="Fail above this rejected share.")
    limit: int | None = Field(default=None, gt=0, description="Read at most this many rows of each source.")
    default_data_source: str | None = Field(default=None, description="data_source when a row has none; default: URL")

    @field_validator("field_map")
    @classmethod
    def _known_fields(cls, value: dict[str, str]) -> dict[str, str]:
        if set(value) - {*FIELDS, IMAGES_FIELD} or not all(value.values()):
            raise ValueError(
                f"field_map={value}: map only {[*FIELDS, IMAGES_FIELD]}, each to a source column or dotted path"
            )
        for field, text in value.items():
            parse_field_source(field, text)
        return value

    def sources(self) -> dict[str, FieldSource]:
        """Each of our fields' source column and transforms (the field's own name when unmapped)."""
        return {name: parse_field_source(name, self.field_map.get(name, name)) for name in FIELDS}

    @model_validator(mode="after")
    def _consistent(self) -> PrepareSpec:
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain the placeholder '{prompt}'; add it or drop the template")
        if self.system_prompt is not None and self.prompt_format != "chat":
            raise ValueError("system_prompt needs prompt_format='chat'; set it, or put the text in prompt_template")
        return self


class PrepareResult(BaseModel):
    """Where the prepared files are and what they hold (JSON-serialisable, e.g. for an Airflow XCom)."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    run_url: str
    train_url: str
    val_url: str
    rejected_url: str
    manifest_url: str
    num_train: int
    num_val: int
    num_rejected: int
    rejected_fraction: float


@dataclass
class _Candidate:
    raw: RawRow
    split: str | None  # "val" for val_source rows; None: the hash decides
    split_key: str  # the raw prompt as text
    prompt: Prompt
    columns: dict[str, Any]  # ground_truth, data_source, extra_info, ability, reward_model
    images: list[bytes] | None = None  # encoded images, each checked to decode


def _lookup(row: Row, path: str) -> Any:
    """``row[path]``, else the dotted walk (``a.b`` = ``row["a"]["b"]``); ``_MISSING`` if absent, None or NaN."""
    value: Any = row.get(path, _MISSING)
    if value is _MISSING:
        value = row
        for part in path.split("."):
            if not isinstance(value, dict) or part not in value:
                return _MISSING
            value = value[part]
    return _MISSING if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _message(message: Any, i: int) -> dict[str, str]:
    if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
        raise Reject("wrong_type", f"prompt message {i} is not a {{'role': str, 'content': str}} object")
    extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
    if extra:
        raise Reject("wrong_type", f"prompt message {i} has keys {extra}; only role and content are supported")
    return {"role": message["role"], "content": message["content"]}


def _format_prompt(value: Any, spec: PrepareSpec) -> Prompt:
    """The prompt with the template applied; chat wrapping and the system prompt come in ``_tokenize``."""
    template = spec.prompt_template
    if isinstance(value, str):
        if not value.strip():
            raise Reject("empty_prompt", "prompt is empty or whitespace")
        return template.replace("{prompt}", value) if template else value  # not str.format: templates hold braces
    if not isinstance(value, list):
        raise Reject("wrong_type", f"prompt is {type(value).__name__}; expected str or a list of chat messages")
    if spec.prompt_format == "text":
        raise Reject("wrong_type", "prompt is a list of chat messages but prompt_format='text'")
    messages = [_message(m, i) for i, m in enumerate(value)]
    if not any(m["content"].strip() for m in messages):
        raise Reject("empty_prompt", "prompt has no message with content")
    users = [m for m in messages if m["role"] == "user"]
    if template and not users:
        raise Reject("wrong_type", "prompt has no user message to apply prompt_template to")
    if template:
        users[-1]["content"] = template.replace("{prompt}", users[-1]["content"])
    return messages


def _scalar(row: Row, path: str, name: str, default: str) -> str:
    value = _lookup(row, path)
    if value is _MISSING or isinstance(value, bool | int | float | str):
        return default if value is _MISSING else str(value)
    raise Reject("wrong_type", f"{name} (field {path!r}) is {type(value).__name__}; expected str or a number")


def _extra_info(row: Row, path: str) -> str:
    value = _lookup(row, path)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):  # a non-JSON string stays a str and is rejected below
            value = json.loads(value)
    value = {} if value is _MISSING else value
    if not isinstance(value, dict):
        raise Reject("wrong_type", f"extra_info (field {path!r}) is not an object or a JSON object string")
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _candidate(raw: RawRow, split: str | None, spec: PrepareSpec, default_source: str) -> _Candidate:
    if raw.error is not None:
        raise raw.error
    row = raw.row
    if not isinstance(row, dict):
        raise Reject("not_an_object", f"row is {type(row).__name__}; expected an object with named fields")
    if (bad_text := text_problem(row)) is not None:
        raise Reject("invalid_text", bad_text)
    sources = spec.sources()
    fields = {name: source.column for name, source in sources.items()}
    value = _lookup(row, fields["prompt"])
    if value is _MISSING:
        raise Reject("missing_prompt", f"no prompt field {fields['prompt']!r} (field_map.prompt); has {sorted(row)}")
    key = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    prompt = _format_prompt(transform_row_value(sources["prompt"], "prompt", value, missing=False), spec)
    verl = "ground_truth" not in spec.field_map and "ground_truth" not in row  # verl nests it in reward_model
    gt_path = _VERL_GROUND_TRUTH if verl else fields["ground_truth"]
    truth = _lookup(row, gt_path)
    columns: dict[str, Any] = {
        "ground_truth": transform_row_value(sources["ground_truth"], "ground_truth", truth, missing=truth is _MISSING)
        if sources["ground_truth"].steps
        else _scalar(row, gt_path, "ground_truth", ""),
        "data_source": _scalar(row, fields["data_source"], "data_source", default_source),
        "extra_info": _extra_info(row, fields["extra_info"]),
        "ability": _scalar(row, fields["ability"], "ability", ""),
    }
    bad_source = _lookup(row, fields["data_source"]) is not _MISSING and data_source_problem(columns["data_source"])
    if bad_source:
        raise Reject("unsafe_data_source", f"{bad_source}; use a name like 'openai/gsm8k'")
    # verl's reward_model column, kept so verl reads the output too; "rule": scored by a rule function.
    columns["reward_model"] = {
        "ground_truth": columns["ground_truth"],
        "style": _scalar(row, "reward_model.style", "reward_model.style", "rule"),
    }
    return _Candidate(raw, split, key, prompt, columns, _images(row, spec, prompt))


def _images(row: Row, spec: PrepareSpec, prompt: Prompt) -> list[bytes] | None:
    """The row's images (None without any); an undecodable image or a placeholder mismatch rejects the row."""
    from rlhf_ops.data.images import ImageError, validate_images

    value = _lookup(row, spec.field_map.get(IMAGES_FIELD, IMAGES_FIELD))
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    try:
        images = validate_images(None if value is _MISSING else value, prompt_text=text)
    except ImageError as exc:
        raise Reject("bad_image", str(exc)) from None
    return images or None


def _rejection(raw: RawRow, reject: Reject) -> Row:
    text = raw.row if isinstance(raw.row, str) else repr(raw.row)
    text = f"{text[:_REPR_LIMIT]}... ({len(text)} chars)" if len(text) > _REPR_LIMIT else text
    kind, reason = reject.args
    return {"row_index": raw.row_index, "source": _redact(raw.source), "kind": kind, "reason": reason, "row": text}


def _read(spec: PrepareSpec, storage_options: Mapping[str, Any] | None) -> list[_Candidate | Row]:
    """Every row of the sources in order: a candidate, or the rejected.jsonl record of a row that failed."""
    items: list[_Candidate | Row] = []
    sources = spec.sources()
    for url, split in [(spec.source, None)] + ([(spec.val_source, "val")] if spec.val_source else []):
        default_source = spec.default_data_source or _redact(url)
        rows = iter_source(url, limit=spec.limit, seed=spec.seed, storage_options=storage_options)
        present: set[str] = set()  # transformed columns some row has: none means a wrong field_map, not bad rows
        example = None
        for raw in itertools.islice(rows, spec.limit):
            if isinstance(raw.row, dict):
                example = example or raw.row
                present.update(s.column for s in sources.values() if _lookup(raw.row, s.column) is not _MISSING)
            try:
                items.append(_candidate(raw, split, spec, default_source))
            except Reject as reject:
                items.append(_rejection(raw, reject))
        if problem := absent_column_problem(sources, present, example):
            raise ValueError(f"{problem} (source {_redact(url)})")
    return items


def _tokenize(
    items: list[_Candidate | Row], spec: PrepareSpec, tokenizer: Any
) -> tuple[list[tuple[_Candidate, Row]], list[Row], bool]:
    """(accepted (candidate, output row), rejected records in source order, whether prompts are chat)."""
    from rlhf_ops.data.dataset import encode_prompt
    from rlhf_ops.data.images import encode_multimodal_prompt, is_processor

    has_images = any(getattr(c, "images", None) for c in items)  # then every output row gets the column
    if has_images and not is_processor(tokenizer):
        raise ValueError(
            "source rows have images but the tokenizer has no image processor; pass the vision-language model's "
            "directory (--tokenizer, e.g. builtin:tiny-vlm) so image tokens are counted like in training"
        )
    # One Parquet type per column: "auto" keeps text only if every prompt is text (a mix is written as chat).
    as_chat = spec.prompt_format == "chat" or any(isinstance(getattr(c, "prompt", ""), list) for c in items)
    accepted, rejected = [], []
    for item in items:
        if not isinstance(item, _Candidate):
            rejected.append(item)
            continue
        prompt = item.prompt
        if as_chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and spec.system_prompt is not None and all(m["role"] != "system" for m in prompt):
            prompt = [{"role": "system", "content": spec.system_prompt}, *prompt]
        try:
            if item.images:
                ids, _ = encode_multimodal_prompt(
                    prompt, item.images, tokenizer, apply_chat_template=spec.apply_chat_template
                )
                n = len(ids)  # placeholders expanded to the model's image tokens, as the trainer counts them
            else:
                n = len(encode_prompt(prompt, tokenizer, apply_chat_template=spec.apply_chat_template))
        except Exception as exc:  # a chat template may raise on a message shape it does not support
            rejected.append(_rejection(item.raw, Reject("tokenize_error", f"{type(exc).__name__}: {exc}")))
            continue
        if n > spec.max_prompt_length:
            reason = f"prompt has {n} tokens > max_prompt_length={spec.max_prompt_length}"
            rejected.append(_rejection(item.raw, Reject("too_long", reason)))
            continue
        images = {IMAGES_FIELD: item.images or []} if has_images else {}
        accepted.append((item, {"prompt": prompt, **item.columns, "prompt_num_tokens": n, **images}))
    return accepted, rejected, as_chat


def split_point(prompt_key: str, *, seed: int) -> float:
    """Uniform number in [0, 1) from sha256(seed, prompt); the row goes to val when it is below ``val_fraction``."""
    digest = hashlib.sha256(f"{seed}\x00{prompt_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _split(accepted: list[tuple[_Candidate, Row]], spec: PrepareSpec) -> tuple[list[Row], list[Row]]:
    """(train rows, val rows) in source order; with ``val_source``, its rows (only) go to val."""
    val_fraction = 0.0 if spec.val_source else spec.val_fraction
    marked = [(c.split == "val" or split_point(c.split_key, seed=spec.seed) < val_fraction, r) for c, r in accepted]
    return [row for to_val, row in marked if not to_val], [row for to_val, row in marked if to_val]


def _check_quality(spec: PrepareSpec, rejected: list[Row], num_read: int, num_train: int, url: str) -> dict[str, int]:
    """The rejected reasons histogram; raises DataQualityError above the threshold or with no train row."""
    reasons = dict(Counter(r["kind"] for r in rejected).most_common())
    share = len(rejected) / num_read if num_read else 1.0
    if share <= spec.max_rejected_fraction and num_train:
        return reasons
    examples = {r["kind"]: r["reason"] for r in reversed(rejected)}  # the first example of each kind
    top = "; ".join(f"{kind}: {n} (e.g. {examples[kind]!r})" for kind, n in list(reasons.items())[:3])
    raise DataQualityError(
        f"data: {len(rejected)} of {num_read} rows rejected, share {share:.4f} vs max_rejected_fraction="
        f"{spec.max_rejected_fraction} ({num_train} train rows left); top reasons: {top or 'none'}; every rejected "
        f"row is in {url}. Fix the source or field_map, or raise max_prompt_length / max_rejected_fraction.",
        share=share,
        threshold=spec.max_rejected_fraction,
        reasons=reasons,
        rejected_url=url,
    )


def _parquet_bytes(rows: list[Row], *, as_chat: bool, with_images: bool = False) -> bytes:
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    columns = [("prompt", message if as_chat else pa.string())]
    columns += [(name, pa.string()) for name in FIELDS[1:]]
    columns += [("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())]))]
    columns += [("prompt_num_tokens", pa.int64())]
    if with_images:
        columns.append((IMAGES_FIELD, pa.list_(pa.binary())))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(columns)), sink)  # no pandas metadata, no time
    return bytes(sink.getvalue().to_pybytes())


def _write_bytes(fs: Any, path: str, data: bytes) -> None:
    """Whole-file write: temporary name + rename on local disk, one PUT (atomic) on object stores."""
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(tmp, data)
    os.replace(tmp, path)


def _remove(fs: Any, *paths: str) -> None:
    for path in [p for p in paths if fs.exists(p)]:
        fs.rm_file(path)


def _manifest(
    spec: PrepareSpec, run_id: str, tokenizer: Any, files: dict[str, tuple[bytes, int]], **stats: Any
) -> Row:
    dumped = spec.model_dump(mode="json")
    dumped.update(source=_redact(spec.source), val_source=spec.val_source and _redact(spec.val_source))
    template = getattr(tokenizer, "chat_template", None)
    return {
        "version": 1,
        "run_id": run_id,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": dumped["source"],
        "spec": dumped,
        "tokenizer": {
            "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "class": type(tokenizer).__name__,
            "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest() if template else None,
        },
        "rejected_fraction": stats["counts"]["rejected"] / stats["counts"]["rows_read"],
        **stats,
        "files": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "num_rows": n}
            for name, (data, n) in files.items()
        },
    }


def prepare_dataset(
    spec: PrepareSpec, *, out_url: str, run_id: str, tokenizer: Any, storage_options: Mapping[str, Any] | None = None
) -> PrepareResult:
    """Validates, tokenises and splits ``spec.source`` into ``<out_url>/<run_id>/`` (see the module docstring).

    Args:
        spec: What to read and the rules to apply.
        out_url: Output root, any fsspec URL (plain path, ``file://``, ``s3://``...).
        run_id: Key of this run's folder (e.g. the Airflow run id); a retry with the same id rewrites it.
        tokenizer: The policy's HF tokenizer (token counts must match the trainer's).
        storage_options: fsspec options (credentials, endpoint) for the sources and ``out_url``; never logged.

    Returns:
        The URLs of the four files and the row counts.

    Raises:
        DataQualityError: the rejected share is above ``spec.max_rejected_fraction`` or no row is left for
            train; ``rejected.jsonl`` is written first, train/val/manifest are not (stale ones are removed).
        ValueError: a bad ``run_id``, or a source that does not exist or has an unsupported layout.
    """
    if not _RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise ValueError(f"run_id={run_id!r} must be 1-200 characters of [A-Za-z0-9._:+=@-] (it names a folder)")
    fs, root = open_fs(out_url, storage_options)
    run_dir, run_url = f"{root.rstrip('/')}/{run_id}", f"{out_url.rstrip('/')}/{run_id}"
    fs.makedirs(run_dir, exist_ok=True)
    _remove(fs, f"{run_dir}/{MANIFEST_FILE}")  # the folder reads as "not prepared" until this attempt commits

    items = _read(spec, storage_options)
    accepted, rejected, as_chat = _tokenize(items, spec, tokenizer)
    jsonl = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected).encode()
    files = {REJECTED_FILE: (jsonl, len(rejected))}
    _write_bytes(fs, f"{run_dir}/{REJECTED_FILE}", jsonl)
    train, val = _split(accepted, spec)
    try:
        reasons = _check_quality(spec, rejected, len(items), len(train), f"{run_url}/{REJECTED_FILE}")
    except DataQualityError:
        _remove(fs, f"{run_dir}/{TRAIN_FILE}", f"{run_dir}/{VAL_FILE}")  # a previous attempt's, now stale
        raise
    for name, rows in ((TRAIN_FILE, train), (VAL_FILE, val)):
        with_images = any(IMAGES_FIELD in row for _, row in accepted)
        files[name] = (_parquet_bytes(rows, as_chat=as_chat, with_images=with_images), len(rows))
        _write_bytes(fs, f"{run_dir}/{name}", files[name][0])
    counts = {"rows_read": len(items), "train": len(train), "val": len(val), "rejected": len(rejected)}
    fmt = "chat" if as_chat else "text"
    manifest = _manifest(spec, run_id, tokenizer, files, counts=counts, rejected_reasons=reasons, prompt_format=fmt)
    _write_bytes(fs, f"{run_dir}/{MANIFEST_FILE}", json.dumps(manifest, indent=2, sort_keys=True).encode())
    if not val:
        logger.warning("prepare_data: val.parquet is empty (val_fraction=%s)", spec.val_fraction)
    logger.info("prepare_data: %s -> %s %s", _redact(spec.source), _redact(run_url), counts)
    return PrepareResult(
        run_id=run_id,
        run_url=run_url,
        **{key: f"{run_url}/{name}" for key, name in _URLS.items()},
        num_train=len(train),
        num_val=len(val),
        num_rejected=len(rejected),
        rejected_fraction=manifest["rejected_fraction"],
    )
