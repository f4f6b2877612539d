"""Download a remote checkpoint, verified against its manifest, into place in one rename.

Files land in a temporary sibling folder of ``local_dir``; each is checked for size and sha256 against
the remote manifest; the manifest is written last; then the folder is renamed to ``local_dir``. A
corrupt or interrupted download leaves nothing at ``local_dir``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem

from rlhf_ops.storage.manifest import (
    MANIFEST_NAME,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    atomic_write_local,
    read_manifest,
    sha256_stream,
)
from rlhf_ops.storage.retry import RetryPolicy, call_with_retries
from rlhf_ops.storage.stores import join_path, open_store, redact_url

logger = logging.getLogger(__name__)


def _fetch_one(fs: AbstractFileSystem, ckpt: str, tmp: Path, entry: FileEntry, policy: RetryPolicy) -> str | None:
    """Download one file into ``tmp`` and return a problem line, or ``None`` when it matches the manifest."""
    target = tmp / entry.path
    target.parent.mkdir(parents=True, exist_ok=True)
    rpath = join_path(ckpt, entry.path)
    try:
        call_with_retries(lambda: fs.get_file(rpath, str(target)), policy=policy, what=f"download {rpath}")
    except FileNotFoundError:
        return f"{entry.path}: missing"
    with open(target, "rb") as stream:
        digest, size = sha256_stream(stream)
    if size != entry.size:
        return f"{entry.path}: size mismatch (manifest {entry.size} bytes, found {size})"
    if digest != entry.sha256:
        return f"{entry.path}: sha256 mismatch (manifest {entry.sha256[:12]}…, found {digest[:12]}…)"
    return None


def _place(tmp: Path, dest: Path, *, overwrite: bool) -> None:
    if not dest.exists():
        os.rename(tmp, dest)  # fails if dest appeared meanwhile and is not empty: never merges folders
        return
    if not overwrite:
        raise FileExistsError(f"{dest} exists; pass overwrite=True or choose another local_dir")
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def download_checkpoint(
    remote_ckpt_url: str,
    local_dir: str | os.PathLike[str],
    *,
    max_workers: int = 4,
    retries: int = 5,
    backoff_s: float = 0.5,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Manifest:
    """Download a complete remote checkpoint to ``local_dir`` and verify every file.

    Args:
        remote_ckpt_url: the remote ``global_step_<N>`` folder (e.g. from ``find_latest_remote``).
        local_dir: the local folder to create (its parent is created if needed).
        max_workers: files downloaded in parallel.
        retries: retries per file for transient errors.
        backoff_s: base of the exponential backoff between retries.
        overwrite: replace an existing ``local_dir`` (only after the download verified).
        storage_options: fsspec options (credentials, endpoint); see ``rlhf_ops.storage.stores``.

    Returns:
        The checkpoint's manifest.

    Raises:
        FileNotFoundError: the remote checkpoint has no manifest (it is incomplete).
        CorruptCheckpointError: files are missing or differ from the manifest; ``problems`` names each file.
        FileExistsError: ``local_dir`` exists and ``overwrite`` is false.
    """
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
    dest = Path(local_dir).absolute()
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} exists; pass overwrite=True or choose another local_dir")
    fs, ckpt = open_store(remote_ckpt_url, storage_options=storage_options)
    url = redact_url(remote_ckpt_url)
    try:
        manifest = call_with_retries(lambda: read_manifest(ckpt, fs=fs), policy=policy, what=f"read {url} manifest")
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} has no {MANIFEST_NAME}: the remote checkpoint is incomplete") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        with ThreadPoolExecutor(max_workers, thread_name_prefix="ckpt-download") as pool:
            results = list(pool.map(lambda e: _fetch_one(fs, ckpt, tmp, e, policy), manifest.files))
        problems = [p for p in results if p is not None]
        if problems:
            raise CorruptCheckpointError(url, problems)
        atomic_write_local(tmp / MANIFEST_NAME, manifest.to_json())
        _place(tmp, dest, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("downloaded %s to %s (%d files, %.1f MB)", url, dest, len(manifest.files), manifest.total_bytes / 1e6)
    return manifest
