"""Text checks of raw data rows that JSON and Parquet let through but no later stage can handle.

- A lone surrogate (``"\\ud800"`` is valid JSON) cannot be encoded as UTF-8: Parquet, ``rejected.jsonl`` and the
  tokenizer would fail on it, so the row is rejected (kind ``invalid_text``) instead of failing the whole run.
- A NUL character is never text; C libraries (tokenizers, databases) truncate at it. Rejected the same way.
- ``data_source`` names a metric path (``val/<data_source>/reward/mean``) and a folder where per-source output is
  written, so a ``.`` or ``..`` segment, a leading ``/``, a ``\\`` or a control character is refused (kind
  ``unsafe_data_source``): ``openai/gsm8k`` is fine, ``../../etc`` is not.
"""

from __future__ import annotations

from typing import Any

MAX_DATA_SOURCE_LENGTH = 200


def _bad_char(text: str) -> str | None:
    if "\x00" in text:
        return "a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate {text[exc.start]!r} (not encodable as UTF-8)"
    return None


def text_problem(value: Any, *, where: str = "row") -> str | None:
    """Why ``value`` (a parsed row: dicts, lists, strings) holds text no later stage can store, or None."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:  # iterative: rows may be deeply nested
        path, node = stack.pop()
        if isinstance(node, str):
            bad = _bad_char(node)
            if bad:
                return f"{path} holds {bad}"
        elif isinstance(node, dict):
            for key, child in node.items():
                bad = _bad_char(str(key))
                if bad:
                    return f"a field name in {path} holds {bad}"
                stack.append((f"{path}.{key}", child))
        elif isinstance(node, list | tuple):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(node))
    return None


def data_source_problem(source: str) -> str | None:
    """Why ``source`` is unsafe as a metric path / folder name, or None (``openai/gsm8k`` is safe)."""
    if not source.strip() or len(source) > MAX_DATA_SOURCE_LENGTH:
        return f"data_source must be 1-{MAX_DATA_SOURCE_LENGTH} characters"
    if source.startswith("/") or "\\" in source or any(ord(ch) < 32 or ord(ch) == 127 for ch in source):
        return f"data_source {source!r} starts with '/' or holds a '\\' or a control character"
    if any(part in ("", ".", "..") for part in source.split("/")):
        return f"data_source {source!r} has an empty, '.' or '..' path segment"
    return None
