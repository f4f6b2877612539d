"""Upload committed checkpoints to a remote store: files, then ``MANIFEST.json``, then ``latest``.

Until its ``MANIFEST.json`` is there, a remote checkpoint is incomplete and nothing treats it as a
checkpoint; re-running the sync finishes it. When the remote already holds a *different* manifest for
the same step (the step was saved again), that manifest is deleted before any file changes, so a
reader never pairs an old manifest with new files.

Incremental uploads, i.e. when a remote file counts as already uploaded. It must have the local size
and a sha256 the store vouches for:

- from the remote manifest, when there is one: the manifest is written after every file it lists,
  and files are never changed while a manifest exists;
- otherwise (an interrupted sync) on S3 from the object's user metadata ``x-amz-meta-sha256``, set by
  the same PUT or multipart upload that wrote the bytes, so it can never describe other bytes;
- otherwise (WebHDFS, HDFS, local) from an empty marker ``<ckpt>/.sync/<file>.sha256-<hex>`` created
  after the file is completely written (stale markers are deleted before a file is rewritten); markers
  are removed once the manifest is up.

An identical remote manifest means the checkpoint is already there: the sync costs one GET and checks
nothing else (audit with ``verify_checkpoint(path, fs=fs)`` or ``find_latest_remote(verify_hashes=True)``).
ETags are not used: they are MD5s only for single-part, unencrypted uploads, and differ between
S3-compatible stores. Size alone is not enough: a re-saved step can have files of the same size.

Memory: up to ``max_workers * part_concurrency * part_size`` bytes of parts are held at once (s3fs
reads each part into memory). Real S3 needs parts of at least 5 MiB (except the last); s3fs switches
to a multipart upload only for files of at least twice the part size, so parts are at least
``multipart_threshold / 2``. Interrupted multipart uploads that s3fs could not abort (a killed
process) keep their parts on S3: give the bucket an ``AbortIncompleteMultipartUpload`` lifecycle rule.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem

from rlhf_ops.storage.manifest import (
    MANIFEST_NAME,
    STEP_DIR_PREFIX,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    apply_retention,
    find_latest_complete,
    is_complete,
    list_file_sizes,
    list_steps,
    parse_step_dir,
    read_latest,
    read_manifest,
    step_dir_name,
    update_latest,
)
from rlhf_ops.storage.retry import RetryPolicy, call_with_retries
from rlhf_ops.storage.stores import is_s3, join_path, open_store, redact_url, scrub_secrets

logger = logging.getLogger(__name__)

MiB = 2**20
S3_MAX_PARTS = 10_000
S3_MAX_SINGLE_PUT = 5 * 2**30
HASH_METADATA_KEY = "sha256"
MARKER_DIR = ".sync"
_MARKER_SEP = ".sha256-"


class SyncError(RuntimeError):
    """Files could not be uploaded after all retries; the remote checkpoint has no manifest.

    Attributes:
        failed: ``{relative path: last error}``.
    """

    def __init__(self, message: str, *, failed: Mapping[str, BaseException]) -> None:
        super().__init__(message)
        self.failed = dict(failed)


@dataclass(kw_only=True)
class SyncReport:
    """What one ``sync_checkpoint`` call did."""

    step: int
    remote_url: str
    """The remote checkpoint folder (password and query stripped)."""
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Files already present remotely with the same size and sha256."""
    bytes_uploaded: int = 0
    retries: int = 0
    """Whole-operation retries by this layer (botocore's per-request retries are not counted)."""
    manifest_uploaded: bool = False
    latest_updated: bool = False
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        """Uploaded megabytes (1e6 bytes) per second of the whole call."""
        return self.bytes_uploaded / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.remote_url}: {len(self.uploaded)} uploaded ({self.bytes_uploaded / 1e6:.1f} MB, "
            f"{self.mb_per_s:.1f} MB/s), {len(self.skipped)} skipped, {self.retries} retries"
        )


@dataclass(kw_only=True)
class RunSyncReport:
    """What one ``sync_run_dir`` call did."""

    remote_run_url: str
    reports: list[SyncReport]
    latest_step: int | None

    def __str__(self) -> str:
        lines = [f"synced {len(self.reports)} checkpoint(s) to {self.remote_run_url}"]
        lines += [f"  {report}" for report in self.reports]
        lines.append(f"  latest: {step_dir_name(self.latest_step) if self.latest_step is not None else 'none'}")
        return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class _Transfer:
    max_workers: int
    multipart_threshold: int
    part_size: int
    part_concurrency: int
    policy: RetryPolicy

    def __post_init__(self) -> None:
        for name in ("max_workers", "multipart_threshold", "part_size", "part_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.multipart_threshold > S3_MAX_SINGLE_PUT:
            raise ValueError(
                f"multipart_threshold must be <= 5 GiB (S3's largest PUT), got {self.multipart_threshold}"
            )

    def s3_chunksize(self, size: int) -> int:
        """The ``chunksize`` for s3fs ``put_file``: it goes multipart iff ``size >= 2 * chunksize``."""
        if size < self.multipart_threshold:
            return max(size, 1)
        return max(min(self.part_size, size // 2), math.ceil(size / S3_MAX_PARTS), 1)


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, _exc: BaseException | None = None) -> None:
        with self._lock:
            self.value += 1


def _load_local_manifest(local: Path) -> Manifest:
    if not local.is_dir():
        raise ValueError(f"local_ckpt_dir {local} is not a directory")
    step = parse_step_dir(local.name)
    if step is None:
        raise ValueError(f"local_ckpt_dir {local} must be named {STEP_DIR_PREFIX}<N>")
    try:
        manifest = read_manifest(local)
    except FileNotFoundError:
        raise ValueError(f"{local} has no {MANIFEST_NAME}: not a committed checkpoint; call write_manifest") from None
    if manifest.step != step:
        raise ValueError(f"{local}/{MANIFEST_NAME} says step {manifest.step}; the folder says {step}")
    problems = []
    for entry in manifest.files:
        path = local / entry.path
        if not path.is_file():
            problems.append(f"{entry.path}: missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{entry.path}: size mismatch (manifest {entry.size} bytes, found {path.stat().st_size})")
    if problems:
        raise CorruptCheckpointError(str(local), problems)
    return manifest


def _remote_manifest(fs: AbstractFileSystem, ckpt: str, policy: RetryPolicy) -> tuple[Manifest | None, bool]:
    """``(manifest or None if unreadable, whether a manifest object exists)``."""
    path = join_path(ckpt, MANIFEST_NAME)
    try:
        data = call_with_retries(lambda: fs.cat_file(path), policy=policy, what=f"read {path}")
    except FileNotFoundError:
        return None, False
    try:
        return Manifest.from_json(data, source=ckpt), True
    except CorruptCheckpointError as exc:
        logger.warning("remote %s is unreadable, replacing it: %s", path, exc)
        return None, True


def _marker_hashes(listing: Mapping[str, int]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for key in listing:
        if key.startswith(f"{MARKER_DIR}/") and _MARKER_SEP in key:
            rel, _, digest = key[len(MARKER_DIR) + 1 :].rpartition(_MARKER_SEP)
            found.setdefault(rel, set()).add(digest)
    return found


def _s3_hash(fs: AbstractFileSystem, path: str, policy: RetryPolicy) -> str | None:
    try:
        meta = call_with_retries(lambda: fs.metadata(path), policy=policy, what=f"head {path}")
    except FileNotFoundError:
        return None
    return meta.get(HASH_METADATA_KEY)


def _plan(
    fs: AbstractFileSystem, ckpt: str, manifest: Manifest, old: Manifest | None, transfer: _Transfer
) -> tuple[list[FileEntry], list[FileEntry], dict[str, int]]:
    """``(to upload, already there, remote listing)``; see the module docstring for "already there"."""
    # a listing is a request like any other: a 503 / reset on it is retried, not a failed sync
    listing = call_with_retries(lambda: list_file_sizes(ckpt, fs=fs), policy=transfer.policy, what=f"list {ckpt}")
    known = {e.path: e.sha256 for e in old.files} if old is not None else {}
    todo: list[FileEntry] = []
    skip: list[FileEntry] = []
    unknown: list[FileEntry] = []
    for entry in manifest.files:
        if listing.get(entry.path) != entry.size:
            todo.append(entry)
        elif entry.path in known:
            (skip if known[entry.path] == entry.sha256 else todo).append(entry)
        else:
            unknown.append(entry)
    if unknown and is_s3(fs):
        with ThreadPoolExecutor(transfer.max_workers, thread_name_prefix="ckpt-head") as pool:
            hashes = list(pool.map(lambda e: _s3_hash(fs, join_path(ckpt, e.path), transfer.policy), unknown))
        for entry, digest in zip(unknown, hashes, strict=True):
            (skip if digest == entry.sha256 else todo).append(entry)
    elif unknown:
        markers = _marker_hashes(listing)
        for entry in unknown:
            (skip if entry.sha256 in markers.get(entry.path, set()) else todo).append(entry)
    return todo, skip, listing


def _upload_one(
    fs: AbstractFileSystem,
    local: Path,
    ckpt: str,
    entry: FileEntry,
    listing: Mapping[str, int],
    transfer: _Transfer,
    counter: _Counter,
) -> None:
    lpath, rpath = str(local / entry.path), join_path(ckpt, entry.path)

    def retrying(fn: Any, what: str) -> None:
        call_with_retries(fn, policy=transfer.policy, what=what, on_retry=counter.add)

    if is_s3(fs):
        chunksize = transfer.s3_chunksize(entry.size)
        meta = {HASH_METADATA_KEY: entry.sha256}
        retrying(
            lambda: fs.put_file(
                lpath, rpath, chunksize=chunksize, max_concurrency=transfer.part_concurrency, Metadata=meta
            ),
            f"upload {rpath}",
        )
        return
    prefix = f"{MARKER_DIR}/{entry.path}{_MARKER_SEP}"
    for stale in [key for key in listing if key.startswith(prefix)]:
        try:  # a marker must never survive a rewrite of its file
            retrying(lambda key=stale: fs.rm_file(join_path(ckpt, key)), f"delete marker {stale}")
        except FileNotFoundError:
            pass
    retrying(lambda: fs.put_file(lpath, rpath), f"upload {rpath}")
    marker = join_path(ckpt, prefix + entry.sha256)
    retrying(lambda: fs.pipe_file(marker, b""), f"write {marker}")


def _upload_files(
    fs: AbstractFileSystem,
    local: Path,
    ckpt: str,
    todo: list[FileEntry],
    listing: Mapping[str, int],
    transfer: _Transfer,
    report: SyncReport,
    counter: _Counter,
) -> None:
    failed: dict[str, BaseException] = {}
    # Largest first keeps the pool busy; on the first failure the files not yet started are cancelled.
    ordered = sorted(todo, key=lambda e: e.size, reverse=True)
    with ThreadPoolExecutor(transfer.max_workers, thread_name_prefix="ckpt-upload") as pool:
        futures: dict[Future[None], FileEntry] = {
            pool.submit(_upload_one, fs, local, ckpt, e, listing, transfer, counter): e for e in ordered
        }
        for future in as_completed(futures):
            entry = futures[future]
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                failed[entry.path] = error
                for other in futures:
                    other.cancel()
            else:
                report.uploaded.append(entry.path)
                report.bytes_uploaded += entry.size
    if failed:
        first = next(iter(failed.values()))
        details = "; ".join(f"{path}: {type(err).__name__}: {scrub_secrets(str(err))}" for path, err in failed.items())
        raise SyncError(
            f"upload to {report.remote_url} failed ({details}; transient errors retried up to "
            f"{transfer.policy.retries}x); it has no {MANIFEST_NAME}, stays incomplete; sync again to finish it",
            failed=failed,
        ) from first


def _upload_checkpoint(
    fs: AbstractFileSystem,
    local: Path,
    ckpt: str,
    manifest: Manifest,
    transfer: _Transfer,
    report: SyncReport,
    counter: _Counter,
) -> None:
    old, present = _remote_manifest(fs, ckpt, transfer.policy)
    if old == manifest:
        report.skipped = [e.path for e in manifest.files]
        return
    manifest_path = join_path(ckpt, MANIFEST_NAME)
    if present:
        logger.warning("%s holds a different or unreadable manifest; replacing the checkpoint", report.remote_url)
        call_with_retries(lambda: fs.rm_file(manifest_path), policy=transfer.policy, what=f"delete {manifest_path}")
    todo, skipped, listing = _plan(fs, ckpt, manifest, old, transfer)
    report.skipped = [e.path for e in skipped]
    _upload_files(fs, local, ckpt, todo, listing, transfer, report, counter)
    data = (local / MANIFEST_NAME).read_bytes()
    call_with_retries(
        lambda: fs.pipe_file(manifest_path, data),
        policy=transfer.policy,
        what=f"upload {manifest_path}",
        on_retry=counter.add,
    )
    report.manifest_uploaded = True
    if not is_s3(fs) and (todo or any(key.startswith(f"{MARKER_DIR}/") for key in listing)):
        try:  # markers are only needed until the manifest is up
            fs.rm(join_path(ckpt, MARKER_DIR), recursive=True)
        except Exception as exc:  # a leftover marker is harmless: log and go on
            logger.warning("could not remove %s/%s: %s", report.remote_url, MARKER_DIR, scrub_secrets(str(exc)))


def advance_latest(fs: AbstractFileSystem, run_root: str, step: int, *, policy: RetryPolicy) -> bool:
    """Point the remote ``latest`` at ``step`` unless it already names ``step`` or a newer complete one.

    Returns:
        Whether ``latest`` was written.
    """
    # every read here is a request that may meet a transient error: retried like the writes
    current = call_with_retries(lambda: read_latest(run_root, fs=fs), policy=policy, what=f"read {run_root}/latest")
    if current == step:
        return False
    if current is not None and current > step:
        newer = join_path(run_root, step_dir_name(current))
        if call_with_retries(lambda: is_complete(newer, fs=fs), policy=policy, what=f"check {newer}"):
            return False
    call_with_retries(lambda: update_latest(run_root, step, fs=fs), policy=policy, what=f"update {run_root}/latest")
    return True


def sync_checkpoint(
    local_ckpt_dir: str | os.PathLike[str],
    remote_run_url: str,
    *,
    max_workers: int = 4,
    retries: int = 5,
    backoff_s: float = 0.5,
    multipart_threshold: int = 64 * MiB,
    part_size: int = 32 * MiB,
    part_concurrency: int = 4,
    set_latest: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> SyncReport:
    """Upload one committed local checkpoint into a remote run folder, incrementally.

    Args:
        local_ckpt_dir: a local ``global_step_<N>`` folder with its ``MANIFEST.json``.
        remote_run_url: the remote run folder; the checkpoint lands in ``<remote_run_url>/global_step_<N>``.
        max_workers: files uploaded in parallel.
        retries: retries per file after the first attempt, for transient errors.
        backoff_s: base of the exponential backoff (with jitter) between retries.
        multipart_threshold: S3 files of at least this size use a multipart upload.
        part_size: S3 multipart part size (raised when a file would need more than 10,000 parts).
        part_concurrency: S3 parts of one file uploaded concurrently.
        set_latest: point the remote ``latest`` at this step afterwards (unless it names a newer complete one).
        storage_options: fsspec options (credentials, endpoint); see ``rlhf_ops.storage.stores``.

    Returns:
        The report; ``uploaded`` is empty when the remote checkpoint was already complete and identical.

    Raises:
        ValueError: the local folder is not a committed checkpoint, or an argument is out of range.
        CorruptCheckpointError: a local file is missing or has another size than its manifest says.
        SyncError: files failed after all retries; the remote checkpoint stays incomplete.
    """
    transfer = _Transfer(
        max_workers=max_workers,
        multipart_threshold=multipart_threshold,
        part_size=part_size,
        part_concurrency=part_concurrency,
        policy=RetryPolicy(retries=retries, backoff_s=backoff_s),
    )
    local = Path(local_ckpt_dir)
    manifest = _load_local_manifest(local)
    fs, run_root = open_store(remote_run_url, storage_options=storage_options)
    ckpt = join_path(run_root, local.name)
    report = SyncReport(step=manifest.step, remote_url=join_path(redact_url(remote_run_url), local.name))
    start, counter = time.perf_counter(), _Counter()
    _upload_checkpoint(fs, local, ckpt, manifest, transfer, report, counter)
    if set_latest:
        report.latest_updated = advance_latest(fs, run_root, manifest.step, policy=transfer.policy)
    report.retries, report.seconds = counter.value, time.perf_counter() - start
    logger.info("synced %s", report)
    return report


def sync_run_dir(local_run_dir: str | os.PathLike[str], remote_run_url: str, **options: Any) -> RunSyncReport:
    """Upload every complete local checkpoint of a run folder, oldest first, then point ``latest``.

    Checkpoints already complete and identical remotely cost one manifest read each. Incomplete local
    checkpoints (no manifest) are left alone.

    Args:
        local_run_dir: the local run folder holding ``global_step_<N>`` folders.
        remote_run_url: the remote run folder.
        **options: keyword arguments of ``sync_checkpoint`` (except ``set_latest``).
    """
    local = Path(local_run_dir)
    if not local.is_dir():
        raise ValueError(f"local_run_dir {local} is not a directory")
    steps = [s for s in list_steps(local) if is_complete(local / step_dir_name(s))]
    reports = [sync_checkpoint(local / step_dir_name(s), remote_run_url, set_latest=False, **options) for s in steps]
    fs, run_root = open_store(remote_run_url, storage_options=options.get("storage_options"))
    if steps:
        policy = RetryPolicy(retries=options.get("retries", 5), backoff_s=options.get("backoff_s", 0.5))
        advance_latest(fs, run_root, steps[-1], policy=policy)
    return RunSyncReport(
        remote_run_url=redact_url(remote_run_url), reports=reports, latest_step=read_latest(run_root, fs=fs)
    )


def find_latest_remote(
    remote_run_url: str, *, storage_options: Mapping[str, Any] | None = None, verify_hashes: bool = False
) -> tuple[int, str] | None:
    """``(step, URL)`` of the newest complete checkpoint in a remote run folder, or ``None``.

    ``verify_hashes`` re-hashes every file of each candidate (reads the whole checkpoint).
    """
    fs, run_root = open_store(remote_run_url, storage_options=storage_options)
    found = find_latest_complete(run_root, fs=fs, verify_hashes=verify_hashes)
    if found is None:
        return None
    return found[0], join_path(remote_run_url, step_dir_name(found[0]))


def apply_remote_retention(
    remote_run_url: str,
    *,
    keep_last: int,
    protect: Iterable[int] = frozenset(),
    storage_options: Mapping[str, Any] | None = None,
) -> list[int]:
    """``rlhf_ops.storage.manifest.apply_retention`` on a remote run folder; returns the deleted steps."""
    fs, run_root = open_store(remote_run_url, storage_options=storage_options)
    return apply_retention(run_root, keep_last=keep_last, protect=protect, fs=fs)
