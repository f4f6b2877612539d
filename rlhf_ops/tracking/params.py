"""Pure helpers that turn a nested config into MLflow-safe params (no MLflow import).

Pipeline: ``flatten_config`` (dotted keys, string values) → ``redact_params`` (secrets never leave
the process) → ``sanitize_key`` (MLflow's charset and path rules) → ``split_overflow`` (values over
the param length limit go to an artifact). ``prepare_params`` runs all four.

The limits below mirror ``mlflow.utils.validation`` of MLflow 3.17; a unit test checks they agree,
so this module stays importable where MLflow is not installed (Airflow side, unit tests).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

# mlflow.utils.validation (3.17.2): MAX_PARAMS_TAGS_PER_BATCH, MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH,
# MAX_TAG_VAL_LENGTH, MAX_ENTITY_KEY_LENGTH. Each log_batch call sends one kind only (metrics, params or tags), so
# MLflow's MAX_ENTITIES_PER_BATCH (1000, all kinds together) never binds.
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_KEY_LENGTH = 250

OVERFLOW_ARTIFACT = "params_overflow.json"
REDACTED = "***REDACTED***"

T = TypeVar("T")

# MLflow accepts [/\w.\- ] (plus ':' off Windows, and any Unicode \w); we keep the portable ASCII subset.
_DISALLOWED_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")

# A path segment (between '.' or '/') whose name marks a secret; everything below it is redacted too.
_SECRET_SEGMENT = re.compile(
    r"(^|[_\-])(password|passwd|passphrase|secret|secrets|credential|credentials|token|auth|authorization"
    r"|bearer|cookie|dsn|connection_?string|conn_?str|private_?key|api_?key|access_?key_?id)$"
)
# Any '*key' leaf is treated as secret unless it names a data column, as verl and TRL configs do.
_KEY_SEGMENT = re.compile(r"(^|[_\-])key$|apikey$")
_SPECIAL_TOKEN_SEGMENT = re.compile(r"^(pad|eos|bos|unk|sep|cls|mask|start|end|image|video|audio|think)_token$")
ALLOWED_KEY_NAMES = frozenset(
    {
        "prompt_key",
        "response_key",
        "chosen_key",
        "rejected_key",
        "label_key",
        "answer_key",
        "input_key",
        "output_key",
        "image_key",
        "video_key",
        "reward_fn_key",
        "data_source_key",
        "ground_truth_key",
        "messages_key",
        "text_key",
        "sort_key",
        "group_key",
        "metric_key",
    }
)
# Credentials embedded in values: URL user-info passwords and well-known token shapes.
# The password may hold '/' and '+' (AWS secret keys do): it runs to the first '@' after the user's ':'.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):(?P<pw>[^@\s]+?)@")
_TOKEN_SHAPES = re.compile(
    r"\b(hf_[A-Za-z0-9]{30,}|(?:AKIA|ASIA)[0-9A-Z]{16}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{30,})\b"
)


def chunked(items: Sequence[T], size: int) -> list[list[T]]:
    """Split ``items`` into consecutive lists of at most ``size`` elements (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"chunked: size must be >= 1, got {size}; pass the MLflow batch limit")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _param_value(value: Any) -> str:
    """Render one leaf value: strings as they are, everything else as compact JSON (``true``, ``null``, ``[1, 2]``)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def flatten_config(config: Mapping[str, Any] | Any, *, sep: str = ".") -> dict[str, str]:
    """Flatten a nested mapping into ``{"a.b.c": "value"}`` with string values.

    Lists and tuples stay one param (as JSON), so a list of data files does not explode the param
    count; an empty mapping becomes ``"{}"`` so that it stays visible. Objects with ``model_dump``
    (pydantic v2 models) are dumped in JSON mode first.

    Args:
        config: Nested mapping, or a pydantic model.
        sep: Separator between nesting levels.

    Returns:
        Flat mapping from dotted key to string value, in the config's own order.
    """
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    if not isinstance(config, Mapping):
        raise ValueError(f"flatten_config: config must be a mapping or pydantic model, got {type(config).__name__}")
    flat: dict[str, str] = {}

    def visit(node: Mapping[Any, Any], prefix: str) -> None:
        for raw_key, value in node.items():
            key = f"{prefix}{sep}{raw_key}" if prefix else str(raw_key)
            if isinstance(value, Mapping) and value:
                visit(value, key)
            elif isinstance(value, Mapping):
                flat[key] = "{}"
            else:
                flat[key] = _param_value(value)

    visit(config, "")
    return flat


def is_secret_key(key: str) -> bool:
    """True when any ``.``/``/``-separated segment of ``key`` names a secret (password, token, api_key…).

    Special tokenizer fields (``pad_token``, ``eos_token``…) and data column names in
    ``ALLOWED_KEY_NAMES`` (``prompt_key``…) are not secrets; any other ``*key`` leaf is.
    """
    for segment in re.split(r"[./]", key.lower()):
        if _SPECIAL_TOKEN_SEGMENT.match(segment) or segment in ALLOWED_KEY_NAMES:
            continue
        if _SECRET_SEGMENT.search(segment) or _KEY_SEGMENT.search(segment):
            return True
    return False


def redact_value(value: str) -> str:
    """Mask credentials inside a value: URL passwords (``s3://u:pw@host`` → ``s3://u:***@host``) and token shapes."""
    value = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}:***@", value)
    return _TOKEN_SHAPES.sub("***", value)


def redact_params(params: Mapping[str, str]) -> dict[str, str]:
    """Replace the values of secret-looking keys by ``REDACTED`` and mask credentials in the other values."""
    return {k: REDACTED if is_secret_key(k) else redact_value(v) for k, v in params.items()}


def redact_config(obj: Any) -> Any:
    """Recursively redact a nested structure (for config and manifest artifacts); the shape is kept.

    A secret key hides its whole subtree (``credentials: {...}`` → ``credentials: REDACTED``).
    """
    if isinstance(obj, Mapping):
        return {str(k): REDACTED if is_secret_key(str(k)) else redact_config(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_config(v) for v in obj]
    if isinstance(obj, str):
        return redact_value(obj)
    return obj


def sanitize_key(key: str) -> str:
    """Map ``key`` to a valid MLflow param/metric/tag name.

    Rules (MLflow 3.17 ``_validate_param_name``): only ``[A-Za-z0-9_\\-. /]`` (others become ``_``);
    the name must equal its ``posixpath.normpath`` (no empty, ``.`` or ``..`` segments, no leading
    or trailing ``/``); at most 250 characters (longer names keep a prefix plus a hash suffix, so
    two long keys stay distinct).

    Examples: ``"val-core/gsm8k/acc@1"`` → ``"val-core/gsm8k/acc_1"``; ``"/a//b/"`` → ``"a/b"``.
    """
    cleaned = _DISALLOWED_KEY_CHARS.sub("_", key)
    segments = [s for s in cleaned.split("/") if s]
    segments = ["_" * len(s) if s in (".", "..") else s for s in segments]
    name = "/".join(segments) or "_"
    if len(name) > MAX_KEY_LENGTH:
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        name = f"{name[: MAX_KEY_LENGTH - 9]}-{digest}"
    assert posixpath.normpath(name) == name, name
    return name


def sanitize_keys(mapping: Mapping[str, T], *, what: str) -> dict[str, T]:
    """Sanitize every key of ``mapping``; two keys that sanitize to the same name raise ``ValueError``."""
    out: dict[str, T] = {}
    origin: dict[str, str] = {}
    for key, value in mapping.items():
        name = sanitize_key(key)
        if name in origin and origin[name] != key:
            raise ValueError(
                f"{what}: keys {origin[name]!r} and {key!r} both map to MLflow name {name!r}; rename one of them"
            )
        out[name], origin[name] = value, key
    return out


def overflow_pointer(value: str) -> str:
    """The param value that stands for a value moved to ``OVERFLOW_ARTIFACT`` (the hash keeps params immutable)."""
    digest = hashlib.sha256(value.encode()).hexdigest()[:12]
    return f"<in {OVERFLOW_ARTIFACT}: {len(value)} chars, sha256 {digest}>"


def split_overflow(
    params: Mapping[str, str], *, max_len: int = MAX_PARAM_VALUE_LENGTH
) -> tuple[dict[str, str], dict[str, str]]:
    """Move values longer than ``max_len`` out of the params.

    Returns:
        ``(params, overflow)``: params where long values are replaced by ``overflow_pointer(value)``,
        and ``{key: full value}`` for the replaced ones (to log as ``OVERFLOW_ARTIFACT``).
    """
    kept: dict[str, str] = {}
    overflow: dict[str, str] = {}
    for key, value in params.items():
        if len(value) > max_len:
            overflow[key] = value
            kept[key] = overflow_pointer(value)
        else:
            kept[key] = value
    return kept, overflow


def prepare_params(config: Mapping[str, Any] | Any) -> tuple[dict[str, str], dict[str, str]]:
    """Flatten, redact, sanitize and split a config: returns ``(params, overflow)`` ready for MLflow."""
    flat = redact_params(flatten_config(config))
    return split_overflow(sanitize_keys(flat, what="log_params"))
