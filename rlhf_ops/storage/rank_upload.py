"""A checkpoint uploaded by many writers (one per rank, each from its own node) and committed by one.

Without a shared filesystem no process holds every file of a checkpoint, so ``sync_checkpoint`` (which uploads a
complete local folder) cannot be used. The same commit rule holds, split across processes:

1. the driver removes a stale remote ``MANIFEST.json`` of the step (:func:`discard_remote_manifest`), so files are
   never rewritten under a manifest;
2. each writer uploads its own files (:func:`upload_files`: hashed locally, sent with ``sync_checkpoint``'s upload
   code: retries, S3 multipart with the sha256 in the object's metadata, markers on other stores) and returns
   their ``FileEntry`` list;
3. once every writer returned, the driver checks that each listed file is on the store with its size and writes
   ``MANIFEST.json`` (the same :class:`~rlhf_ops.storage.manifest.Manifest` format), then ``latest``
   (:func:`commit_remote_checkpoint`).

Until step 3 the remote checkpoint has no manifest, so it is incomplete and nothing resumes from it.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_ops.storage.manifest import (
    MANIFEST_NAME,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    list_file_sizes,
    parse_step_dir,
    sha256_stream,
)
from rlhf_ops.storage.retry import RetryPolicy, call_with_retries
from rlhf_ops.storage.stores import is_s3, join_path, open_store, redact_url, scrub_secrets
from rlhf_ops.storage.sync import MARKER_DIR, SyncReport, _Counter, _Transfer, _upload_files, advance_latest

logger = logging.getLogger(__name__)

MiB = 2**20


def _step_of(remote_ckpt_url: str) -> int:
    step = parse_step_dir(remote_ckpt_url)
    if step is None:
        raise ValueError(f"{redact_url(remote_ckpt_url)} must end with a global_step_<N> folder")
    return step


def discard_remote_manifest(
    remote_ckpt_url: str, *, storage_options: Mapping[str, Any] | None = None, retries: int = 5
) -> bool:
    """Delete the remote ``MANIFEST.json`` of a checkpoint about to be written again; whether there was one."""
    fs, ckpt = open_store(remote_ckpt_url, storage_options=storage_options)
    path = join_path(ckpt, MANIFEST_NAME)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return False
    logger.warning("%s is saved again: deleting its manifest first", redact_url(remote_ckpt_url))
    policy = RetryPolicy(retries=retries, backoff_s=0.5)
    call_with_retries(lambda: fs.rm_file(path), policy=policy, what=f"delete {path}")
    return True


def upload_files(
    local_ckpt_dir: str | os.PathLike[str],
    remote_ckpt_url: str,
    rel_paths: Iterable[str],
    *,
    max_workers: int = 4,
    retries: int = 5,
    backoff_s: float = 0.5,
    multipart_threshold: int = 64 * MiB,
    part_size: int = 32 * MiB,
    part_concurrency: int = 4,
    storage_options: Mapping[str, Any] | None = None,
) -> list[FileEntry]:
    """Upload some files of a local checkpoint folder to the same relative paths of a remote one; no manifest.

    Args:
        local_ckpt_dir: this writer's local ``global_step_<N>`` folder.
        remote_ckpt_url: the remote ``global_step_<N>`` folder.
        rel_paths: the files to upload, relative to ``local_ckpt_dir`` (``actor/__1_0.distcp``).
        max_workers, retries, backoff_s, multipart_threshold, part_size, part_concurrency, storage_options:
            as in :func:`rlhf_ops.storage.sync.sync_checkpoint`.

    Returns:
        One entry per file (path, size, sha256 of the local bytes), sorted by path: what the manifest lists.

    Raises:
        SyncError: files failed after all retries (the remote checkpoint stays without a manifest).
    """
    transfer = _Transfer(
        max_workers=max_workers,
        multipart_threshold=multipart_threshold,
        part_size=part_size,
        part_concurrency=part_concurrency,
        policy=RetryPolicy(retries=retries, backoff_s=backoff_s),
    )
    local = Path(local_ckpt_dir)
    entries = []
    for rel in sorted(set(rel_paths)):
        with open(local / rel, "rb") as stream:
            digest, size = sha256_stream(stream)
        entries.append(FileEntry(path=rel, size=size, sha256=digest))
    fs, ckpt = open_store(remote_ckpt_url, storage_options=storage_options)
    report = SyncReport(step=_step_of(remote_ckpt_url), remote_url=redact_url(remote_ckpt_url))
    listing = list_file_sizes(ckpt, fs=fs) if not is_s3(fs) else {}  # stale markers to delete (non-S3 stores)
    _upload_files(fs, local, ckpt, entries, listing, transfer, report, _Counter())
    return entries


def commit_remote_checkpoint(
    remote_ckpt_url: str,
    files: Iterable[FileEntry],
    *,
    extra: dict[str, Any] | None = None,
    set_latest: bool = True,
    retries: int = 5,
    backoff_s: float = 0.5,
    storage_options: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write ``MANIFEST.json`` of a remote checkpoint whose files every writer uploaded, then ``latest``.

    Args:
        remote_ckpt_url: the remote ``global_step_<N>`` folder.
        files: the entries every writer's :func:`upload_files` returned, all together.
        extra: JSON metadata kept in the manifest (``{"roles": [...]}``, as ``write_manifest`` is given).
        set_latest: point the run folder's ``latest`` at this step (unless it names a newer complete one).
        retries, backoff_s: retries of each store request.
        storage_options: fsspec options (credentials, endpoint).

    Returns:
        The manifest written.

    Raises:
        CorruptCheckpointError: a listed file is not on the store with its size, or two writers listed one path;
            nothing is written.
    """
    step = _step_of(remote_ckpt_url)
    entries = sorted(files, key=lambda e: e.path)
    policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
    fs, ckpt = open_store(remote_ckpt_url, storage_options=storage_options)
    url = redact_url(remote_ckpt_url)
    sizes = list_file_sizes(ckpt, fs=fs)
    problems = [f"{path}: listed by {n} writers" for path, n in Counter(e.path for e in entries).items() if n > 1]
    for entry in entries:
        found = sizes.get(entry.path)
        if found is None:
            problems.append(f"{entry.path}: missing")
        elif found != entry.size:
            problems.append(f"{entry.path}: size mismatch (manifest {entry.size} bytes, found {found})")
    if problems:
        raise CorruptCheckpointError(url, problems)
    manifest = Manifest(step=step, created_at=datetime.now(UTC).isoformat(), files=entries, extra=extra or {})
    data = manifest.to_json()
    manifest_path = join_path(ckpt, MANIFEST_NAME)
    call_with_retries(lambda: fs.pipe_file(manifest_path, data), policy=policy, what=f"upload {manifest_path}")
    if not is_s3(fs) and any(key.startswith(f"{MARKER_DIR}/") for key in sizes):
        try:  # markers are only needed until the manifest is up
            fs.rm(join_path(ckpt, MARKER_DIR), recursive=True)
        except Exception as exc:  # a leftover marker is harmless: log and go on
            logger.warning("could not remove %s/%s: %s", url, MARKER_DIR, scrub_secrets(str(exc)))
    if set_latest:
        advance_latest(fs, ckpt.rsplit("/", 1)[0], step, policy=policy)
    logger.info("committed %s: %d files, %.1f MB", url, len(entries), manifest.total_bytes / 1e6)
    return manifest
