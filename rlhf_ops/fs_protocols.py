"""Which URL schemes a store accepts: every protocol fsspec knows, usable once its implementation is installed.

fsspec's own tables decide (``fsspec.registry`` for registered classes, ``known_implementations`` for the
ones it can import by name), so a store added by installing a package (``gcsfs`` for ``gs://``, ``adlfs``
for ``abfs://``) works without a change here. This module imports fsspec only: the configuration checks
a scheme with :func:`unknown_protocol_problem` (no implementation import, the Airflow side may lack the
package a worker has) and the storage layer with :func:`store_protocol_problem` (imports it).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import fsspec
from fsspec.registry import known_implementations, registry


def url_scheme(url: str) -> str:
    """The scheme of a store URL, lower-cased; ``"file"`` for a plain path."""
    return urlsplit(url).scheme.lower() if "://" in url else "file"


def known_protocols() -> list[str]:
    """Every protocol fsspec can name: registered classes and the implementations it imports by name."""
    return sorted(set(registry) | set(known_implementations))


def unknown_protocol_problem(scheme: str) -> str | None:
    """None when fsspec knows ``scheme``, else a one-line reason and fix (no implementation is imported)."""
    if scheme in registry or scheme in known_implementations:
        return None
    return (
        f"fsspec knows no protocol {scheme!r}; use one of file://, s3://, gs://, abfs://, hdfs://, webhdfs://, "
        "memory:// (any protocol in fsspec.registry.known_implementations) or register one with "
        "fsspec.register_implementation"
    )


def store_protocol_problem(scheme: str) -> str | None:
    """None when ``scheme``'s fsspec implementation imports, else a one-line reason and the package to install."""
    unknown = unknown_protocol_problem(scheme)
    if unknown:
        return unknown
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        hint = known_implementations.get(scheme, {}).get("err") or str(exc)
        return f"the fsspec implementation of {scheme}:// is not installed ({' '.join(str(hint).split())})"
    return None
