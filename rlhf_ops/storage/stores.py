"""Open a checkpoint store from a URL: ``file://`` or a plain path, ``s3://``, ``hdfs://``, ``webhdfs://``, or any
other protocol whose fsspec implementation is installed (``gs://`` with gcsfs, ``abfs://`` with adlfs,
``memory://``...; :mod:`rlhf_ops.fs_protocols`).

Where credentials come from (never from the run config, never logged):

- ``s3://bucket/prefix``: s3fs/botocore's usual chain (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, instance or IRSA roles); the endpoint of any S3-compatible store
  from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``; the region from ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION``. Or ``storage_options`` that the caller builds, e.g. from an Airflow connection:
  ``{"key": ..., "secret": ..., "token": ..., "endpoint_url": ..., "client_kwargs": {"region_name": ...}}``.
  Options win over the environment.
- ``webhdfs://namenode:port/path``: the NameNode HTTP port (9870 on Hadoop 3, 50070 on Hadoop 2);
  ``storage_options`` ``user``, ``kerberos=True`` (needs ``requests-kerberos`` and a ``kinit``),
  ``token``, ``use_https``, ``data_proxy`` (fsspec's ``WebHDFS``).
- ``hdfs://namenode:port/path``: pyarrow's libhdfs binding; needs ``libhdfs.so``, ``JAVA_HOME`` and
  ``CLASSPATH`` (``hadoop classpath --glob``); ``storage_options`` ``user``, ``kerb_ticket``, ``replication``.

S3 requests are retried by botocore in "standard" mode (4 attempts per request, unless the caller passes
``config_kwargs={"retries": ...}``); sync adds whole-file retries on top (``rlhf_ops.storage.retry``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from rlhf_ops.fs_protocols import store_protocol_problem
from rlhf_ops.fs_protocols import url_scheme as url_scheme

# The schemes this module configures itself (S3 endpoint/region/retries, hdfs hints); every other installed
# fsspec protocol is opened with the caller's storage options as they are.
SUPPORTED_SCHEMES = ("file", "s3", "hdfs", "webhdfs")
_S3_DEFAULT_RETRIES = {"mode": "standard", "total_max_attempts": 4}
# Query parameters that carry credentials in error messages (WebHDFS delegation tokens, presigned S3 URLs).
_SECRET_PARAM = re.compile(
    r"(?i)\b(delegation|token|signature|x-amz-signature|x-amz-credential|x-amz-security-token)=[^&\s'\"]+"
)


def store_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that s3fs / boto3 read (``AWS_*``), for another
    process that must open the same stores (a rank that uploads its own checkpoint shards)."""
    env = os.environ if environ is None else environ
    return {key: value for key, value in env.items() if key.startswith("AWS_")}


def redact_url(url: str) -> str:
    """The URL without a password or query string, safe to log."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def scrub_secrets(text: str) -> str:
    """``text`` with credential-bearing query parameters (``delegation=``, ``X-Amz-Signature=``...) masked."""
    return _SECRET_PARAM.sub(lambda m: f"{m.group(1)}=***", text)


def is_s3(fs: AbstractFileSystem) -> bool:
    """Whether ``fs`` is an s3fs filesystem."""
    protocol = fs.protocol
    return "s3" in ((protocol,) if isinstance(protocol, str) else protocol)


def join_path(root: str, *parts: str) -> str:
    """Join store paths with ``/`` (store paths are never OS paths)."""
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def _s3_options(options: dict[str, Any]) -> dict[str, Any]:
    client_kwargs = dict(options.get("client_kwargs") or {})
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options and "endpoint_url" not in client_kwargs:
        options["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION")
    if region and "region_name" not in client_kwargs and not os.environ.get("AWS_DEFAULT_REGION"):
        client_kwargs["region_name"] = region  # botocore itself only reads AWS_DEFAULT_REGION
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    config_kwargs = dict(options.get("config_kwargs") or {})
    config_kwargs.setdefault("retries", dict(_S3_DEFAULT_RETRIES))
    options["config_kwargs"] = config_kwargs
    return options


def open_store(url: str, *, storage_options: Mapping[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and root path of a store URL.

    Args:
        url: ``file:///abs/dir``, ``/abs/dir``, ``relative/dir``, ``s3://bucket/prefix``,
            ``hdfs://host:port/dir``, ``webhdfs://host:port/dir`` or ``<protocol>://...`` of any installed
            fsspec implementation.
        storage_options: keyword arguments of the fsspec filesystem (credentials, endpoint); see the
            module docstring. Never logged.

    Returns:
        ``(fs, root)``: ``root`` is ``url``'s path as ``fs`` names it (``bucket/prefix`` on S3, an absolute
        path otherwise), without a trailing ``/``.
    """
    scheme = url_scheme(url)
    problem = store_protocol_problem(scheme)
    if problem:
        raise ValueError(f"store URL {redact_url(url)!r}: {problem}")
    options = dict(storage_options or {})
    if scheme == "file":
        options.setdefault("auto_mkdir", True)
    elif scheme == "s3":
        options = _s3_options(options)
    try:
        fs, path = url_to_fs(url, **options)
    except OSError as exc:
        if scheme != "hdfs":
            raise
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise OSError(
            f"hdfs:// needs a JVM and libhdfs (JAVA_HOME, ARROW_LIBHDFS_DIR, CLASSPATH=$(hadoop classpath --glob)) "
            f"and a reachable NameNode; or use webhdfs://host:port/... ({first_line})"
        ) from exc
    return fs, str(path).rstrip("/") or str(path)
