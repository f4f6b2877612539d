"""Checkpoint manifests: the commit marker of a checkpoint, the ``latest`` pointer, and retention.

Layout, on local disk or on any fsspec store (``fs`` argument; ``None`` means local disk)::

    <run_dir>/global_step_<N>/...            files written by the checkpointer
    <run_dir>/global_step_<N>/MANIFEST.json  written last: no manifest, no checkpoint
    <run_dir>/latest                         text ``global_step_<N>``, updated only after the manifest

``MANIFEST.json`` lists every file of the checkpoint with its size and sha256. Locally it is written
through a temporary file and ``os.replace``, so a reader sees either no manifest or a whole one; on an
object store one PUT is atomic. Everything that decides whether a checkpoint exists (resume, sync,
retention) asks for the manifest, never for the folder.

``latest`` exists for people and tools that expect verl's pointer file. This module treats the
manifests as the truth: ``find_latest_complete`` returns the newest checkpoint that has a manifest,
which is never older than what a valid ``latest`` names (``latest`` may lag by one checkpoint after a
crash between the manifest and the pointer). To roll a run back, delete the newer checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

logger = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.json"
LATEST_NAME = "latest"
MANIFEST_VERSION = 1
STEP_DIR_PREFIX = "global_step_"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_HASH_CHUNK = 8 * 2**20  # hashlib releases the GIL on buffers this size, so threads hash in parallel
_LOCAL = LocalFileSystem()


class CorruptCheckpointError(Exception):
    """A checkpoint whose files do not match its manifest, or whose manifest cannot be read.

    Attributes:
        path: the checkpoint folder (local path or URL).
        problems: one line per problem, each starting with the file's relative path.
    """

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = list(problems)
        super().__init__(f"checkpoint {path} failed verification: " + "; ".join(self.problems))


class FileEntry(BaseModel):
    """One file of a checkpoint: ``path`` is relative to the checkpoint folder, with ``/`` separators."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _relative_inside(cls, value: str) -> str:
        # Manifests also come from remote stores: a path must never escape the checkpoint folder.
        pure = PurePosixPath(value)
        if not value or pure.is_absolute() or ".." in pure.parts or "\\" in value or pure.as_posix() != value:
            raise ValueError(f"file path {value!r} must be relative, normalised, '/'-separated, without '..'")
        if value == MANIFEST_NAME:
            raise ValueError(f"{MANIFEST_NAME} cannot list itself")
        return value


class Manifest(BaseModel):
    """The content of ``MANIFEST.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = MANIFEST_VERSION
    step: int = Field(ge=0)
    created_at: str
    files: list[FileEntry]
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if not 1 <= value <= MANIFEST_VERSION:
            raise ValueError(f"manifest version {value} is not supported (this code reads 1..{MANIFEST_VERSION})")
        return value

    @property
    def total_bytes(self) -> int:
        """Sum of the sizes of all listed files."""
        return sum(entry.size for entry in self.files)

    def to_json(self) -> bytes:
        """The bytes written to ``MANIFEST.json``."""
        return (json.dumps(self.model_dump(), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str) -> Manifest:
        """Parse manifest bytes; raises ``CorruptCheckpointError`` naming ``source`` if they are invalid."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            problem = f"{MANIFEST_NAME}: unreadable ({exc.error_count()} error(s): {exc})"
            raise CorruptCheckpointError(source, [problem]) from exc


def step_dir_name(step: int) -> str:
    """``global_step_<step>``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_DIR_PREFIX}{step}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``global_step_<N>`` folder name (a basename or a path), or ``None``."""
    match = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def _join(base: str | os.PathLike[str], *parts: str) -> str:
    return "/".join([os.fspath(base).rstrip("/"), *parts])


def _root(fs: AbstractFileSystem, path: str | os.PathLike[str]) -> str:
    return str(fs._strip_protocol(os.fspath(path))).rstrip("/")


def sha256_stream(stream: IO[bytes]) -> tuple[str, int]:
    """Hex sha256 and byte count of a binary stream, read in 8 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(_HASH_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _hash_file(fs: AbstractFileSystem, path: str) -> tuple[str, int]:
    with fs.open(path, "rb") as stream:
        return sha256_stream(stream)


def _local_file_names(root: Path) -> list[str]:
    names = []
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            rel = (Path(dirpath) / filename).relative_to(root).as_posix()
            # Skip the manifest and its temporary files from an interrupted write_manifest.
            if rel != MANIFEST_NAME and not rel.startswith(f".{MANIFEST_NAME}."):
                names.append(rel)
    return sorted(names)


def _umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, which races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def apply_default_modes(root: str | os.PathLike[str]) -> None:
    """Gives ``root`` and everything under it the modes ``open()`` / ``mkdir`` would (0666 / 0777 less the umask).

    For folders written through a temp sibling and renamed into place: ``tempfile.mkdtemp`` makes 0700 folders
    and safetensors writes its files 0600, which other users of a shared folder (Airflow's worker reading what a
    Ray job wrote, a serving process) could not read.
    """
    umask = _umask()
    top = Path(root)
    os.chmod(top, 0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames:
            os.chmod(Path(dirpath) / name, 0o777 & ~umask)
        for name in filenames:
            os.chmod(Path(dirpath) / name, 0o666 & ~umask)


def atomic_write_local(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a local file through a temp file in the same folder, fsync, and ``os.replace``.

    The file gets the mode a plain ``open()`` would give it (0666 less the umask), not ``mkstemp``'s 0600: a
    shared work folder is read by other users (the Ray nodes write a job's result, Airflow's worker reads it).
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:  # make the rename itself durable
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_manifest(
    ckpt_dir: str | os.PathLike[str], *, step: int, extra: dict[str, Any] | None = None, max_workers: int = 4
) -> Manifest:
    """Hash every file under a local checkpoint folder and write ``MANIFEST.json`` last, atomically.

    Call it after every rank has finished writing (and after a barrier). An existing manifest is replaced.

    Args:
        ckpt_dir: the local ``global_step_<N>`` folder.
        step: the global step the checkpoint holds.
        extra: JSON-serialisable metadata kept in the manifest (e.g. metrics, config hash).
        max_workers: threads hashing files in parallel.

    Returns:
        The manifest written.
    """
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise ValueError(f"ckpt_dir {root} is not a directory: save the checkpoint files before write_manifest")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")

    def entry(rel: str) -> FileEntry:
        with open(root / rel, "rb") as stream:
            digest, size = sha256_stream(stream)
        return FileEntry(path=rel, size=size, sha256=digest)

    with ThreadPoolExecutor(max_workers, thread_name_prefix="manifest-hash") as pool:
        files = list(pool.map(entry, _local_file_names(root)))
    manifest = Manifest(step=step, created_at=datetime.now(UTC).isoformat(), files=files, extra=extra or {})
    atomic_write_local(root / MANIFEST_NAME, manifest.to_json())
    return manifest


def read_manifest(ckpt_path: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None) -> Manifest:
    """Read ``<ckpt_path>/MANIFEST.json``.

    Raises:
        FileNotFoundError: no manifest (the checkpoint is incomplete).
        CorruptCheckpointError: the manifest exists but is not a valid manifest.
    """
    fs = fs or _LOCAL
    path = _join(_root(fs, ckpt_path), MANIFEST_NAME)
    fs.invalidate_cache(path)  # s3fs sizes the GET from its listing cache: a stale one hides another process's write
    data = fs.cat_file(path)
    return Manifest.from_json(data, source=os.fspath(ckpt_path))


def list_file_sizes(ckpt_path: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None) -> dict[str, int]:
    """``{relative path: size}`` of every file under a checkpoint folder, in one recursive listing."""
    fs = fs or _LOCAL
    root = _root(fs, ckpt_path)
    fs.invalidate_cache(root)
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    return {str(name)[len(root) + 1 :]: int(info["size"]) for name, info in found.items()}


def verify_checkpoint(
    ckpt_path: str | os.PathLike[str],
    *,
    fs: AbstractFileSystem | None = None,
    check_hashes: bool = True,
    max_workers: int = 4,
) -> list[str]:
    """Compare a checkpoint's files with its manifest.

    Args:
        ckpt_path: the ``global_step_<N>`` folder (path on ``fs``).
        fs: the filesystem; ``None`` means local disk.
        check_hashes: also re-hash every file (reads all bytes); otherwise sizes only.
        max_workers: threads hashing in parallel.

    Returns:
        Problems, one per line, each starting with the file's relative path (``"a.pt: missing"``,
        ``"a.pt: size mismatch ..."``, ``"a.pt: sha256 mismatch ..."``); empty when the checkpoint is intact.
        Files not listed in the manifest are ignored.
    """
    fs = fs or _LOCAL
    try:
        manifest = read_manifest(ckpt_path, fs=fs)
    except FileNotFoundError:
        return [f"{MANIFEST_NAME}: missing (checkpoint incomplete)"]
    except CorruptCheckpointError as exc:
        return exc.problems
    sizes = list_file_sizes(ckpt_path, fs=fs)
    problems: list[str] = []
    to_hash: list[FileEntry] = []
    for entry in manifest.files:
        size = sizes.get(entry.path)
        if size is None:
            problems.append(f"{entry.path}: missing")
        elif size != entry.size:
            problems.append(f"{entry.path}: size mismatch (manifest {entry.size} bytes, found {size})")
        elif check_hashes:
            to_hash.append(entry)
    root = _root(fs, ckpt_path)
    with ThreadPoolExecutor(max_workers, thread_name_prefix="verify-hash") as pool:
        digests = pool.map(lambda e: _hash_file(fs, _join(root, e.path))[0], to_hash)
        for entry, digest in zip(to_hash, digests, strict=True):
            if digest != entry.sha256:
                problems.append(f"{entry.path}: sha256 mismatch (manifest {entry.sha256[:12]}…, found {digest[:12]}…)")
    return problems


def is_complete(
    ckpt_path: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None, verify_hashes: bool = False
) -> bool:
    """Whether a checkpoint is committed: its manifest exists, parses, and names the folder's step.

    With ``verify_hashes`` every file is also checked against the manifest (reads every byte).
    """
    try:
        manifest = read_manifest(ckpt_path, fs=fs)
    except (FileNotFoundError, CorruptCheckpointError):
        return False
    folder_step = parse_step_dir(os.fspath(ckpt_path))
    if folder_step is not None and folder_step != manifest.step:
        logger.warning("%s holds a manifest for step %d; treating it as incomplete", ckpt_path, manifest.step)
        return False
    if verify_hashes:
        problems = verify_checkpoint(ckpt_path, fs=fs)
        if problems:
            logger.warning("checkpoint %s is corrupt: %s", ckpt_path, "; ".join(problems))
        return not problems
    return True


def list_steps(run_dir: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None) -> list[int]:
    """Steps of every ``global_step_<N>`` folder in a run folder (complete or not), ascending."""
    fs = fs or _LOCAL
    root = _root(fs, run_dir)
    fs.invalidate_cache(root)
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    steps = [parse_step_dir(str(e["name"])) for e in entries if e.get("type") == "directory"]
    return sorted(s for s in steps if s is not None)


def read_latest(run_dir: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None) -> int | None:
    """The step named by ``<run_dir>/latest``, or ``None`` if it is absent or unreadable."""
    fs = fs or _LOCAL
    path = _join(_root(fs, run_dir), LATEST_NAME)
    fs.invalidate_cache(path)  # as in read_manifest: a listing cached before another process wrote it
    try:
        text = fs.cat_file(path).decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    return parse_step_dir(text)


def update_latest(run_dir: str | os.PathLike[str], step: int, *, fs: AbstractFileSystem | None = None) -> None:
    """Point ``<run_dir>/latest`` at ``global_step_<step>``, which must already have its manifest.

    Local disk: temp file + ``os.replace``. Object stores: one PUT, atomic. HDFS/WebHDFS: create and
    write, not atomic for a concurrent reader; readers treat an unreadable pointer as absent.
    """
    fs = fs or _LOCAL
    root = _root(fs, run_dir)
    name = step_dir_name(step)
    if not fs.exists(_join(root, name, MANIFEST_NAME)):
        raise ValueError(f"cannot point {root}/{LATEST_NAME} at {name}: it has no {MANIFEST_NAME}; commit it first")
    if isinstance(fs, LocalFileSystem):
        atomic_write_local(_join(root, LATEST_NAME), name.encode())
    else:
        fs.pipe_file(_join(root, LATEST_NAME), name.encode())


def find_latest_complete(
    run_dir: str | os.PathLike[str], *, fs: AbstractFileSystem | None = None, verify_hashes: bool = False
) -> tuple[int, str] | None:
    """The newest complete checkpoint of a run folder, scanning ``global_step_*`` newest first.

    Args:
        run_dir: the run folder (path on ``fs``).
        fs: the filesystem; ``None`` means local disk.
        verify_hashes: also verify every file of a candidate; a corrupt one is skipped with a warning.

    Returns:
        ``(step, path)`` with ``path`` on ``fs``, or ``None`` when the run has no complete checkpoint.
    """
    fs = fs or _LOCAL
    root = _root(fs, run_dir)
    pointer = read_latest(root, fs=fs)
    for step in reversed(list_steps(root, fs=fs)):
        path = _join(root, step_dir_name(step))
        if is_complete(path, fs=fs, verify_hashes=verify_hashes):
            if pointer != step:  # missing, unreadable, or naming another (incomplete, removed) checkpoint
                logger.warning(
                    "%s/%s %s; resuming from the newest complete checkpoint, step %d",
                    root,
                    LATEST_NAME,
                    "is missing or unreadable" if pointer is None else f"names step {pointer}",
                    step,
                )
            return step, path
        logger.info("skipping %s: incomplete or corrupt", path)
    return None


def _delete_checkpoint(fs: AbstractFileSystem, path: str) -> None:
    # Manifest first: an interrupted delete leaves an incomplete checkpoint, never a complete-looking one.
    try:
        fs.rm_file(_join(path, MANIFEST_NAME))
    except FileNotFoundError:
        pass
    fs.rm(path, recursive=True)


def apply_retention(
    run_dir: str | os.PathLike[str],
    *,
    keep_last: int,
    protect: Iterable[int] = frozenset(),
    fs: AbstractFileSystem | None = None,
) -> list[int]:
    """Delete old checkpoints of a run folder, local or remote.

    Kept: the ``keep_last`` newest complete checkpoints (``0`` keeps every complete one), every step in
    ``protect`` (e.g. the best by a metric), the newest complete one, the one ``latest`` names, and
    incomplete ones newer than the newest complete one (they may still be written). Deleted: other complete
    checkpoints and incomplete ones older than the newest complete one (abandoned writes). When no
    checkpoint is complete nothing is deleted.

    Returns:
        The deleted steps, ascending.
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 (0 keeps every complete checkpoint), got {keep_last}")
    fs = fs or _LOCAL
    root = _root(fs, run_dir)
    steps = list_steps(root, fs=fs)
    complete = [s for s in steps if is_complete(_join(root, step_dir_name(s)), fs=fs)]
    if not complete:
        return []
    newest = complete[-1]
    keep = set(protect) | {newest} | set(complete[-keep_last:] if keep_last else complete)
    pointer = read_latest(root, fs=fs)
    if pointer is not None:
        keep.add(pointer)
    deleted = [s for s in steps if s < newest and s not in keep]
    for step in deleted:
        path = _join(root, step_dir_name(step))
        logger.info("retention: deleting %s", path)
        _delete_checkpoint(fs, path)
    return deleted
