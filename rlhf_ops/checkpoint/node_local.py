"""Checkpoints without a shared filesystem (``trainer.shared_checkpoint_root=false``): the ranks' side, torch-free.

Each rank writes its shards into its own node's folder (the run's usual layout under ``node_checkpoint_root``),
uploads the files it wrote to the checkpoint's remote folder, deletes them locally and returns what it uploaded
(:func:`upload_rank_files`); the driver commits the manifest once every rank returned
(``rlhf_ops.checkpoint.manager``). On resume each node downloads the checkpoint from the store into its folder
once, whichever rank of the node comes first, and every rank loads from there (:func:`fetch_to_node`).

``{rank}`` in the node run folder becomes the rank: separate folders per rank stand for separate nodes on one
machine (tests). Without it, the ranks of one node share the folder, each touching only its own files.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlhf_ops.storage.manifest import FileEntry, is_complete, read_manifest

log = logging.getLogger(__name__)

RANK_PLACEHOLDER = "{rank}"


@dataclass(frozen=True, kw_only=True)
class NodeCheckpoint:
    """One checkpoint as a rank sees it: a folder on its own node and the folder on the remote store."""

    node_run_dir: str
    """The run folder on each node (``<node root>/<experiment>/<run>``); ``{rank}`` becomes the rank."""
    step_dir: str
    """``global_step_<N>``."""
    remote_url: str
    """The checkpoint's remote folder (``<remote_store_url>/<experiment>/<run>/global_step_<N>``)."""

    def local_dir(self, rank: int) -> Path:
        """This rank's ``global_step_<N>`` folder on its node (absolute: ranks may run in another folder)."""
        return Path(self.node_run_dir.replace(RANK_PLACEHOLDER, str(rank))).absolute() / self.step_dir


@dataclass(frozen=True, kw_only=True)
class RankUpload:
    """What one rank wrote on its node and uploaded."""

    rank: int
    local_dir: str
    """The node folder it wrote into (and emptied of its files after the upload)."""
    files: list[FileEntry]
    """Paths relative to the checkpoint folder (``actor/__1_0.distcp``), sizes and sha256 of the bytes sent."""


def upload_rank_files(ckpt: NodeCheckpoint, *, rank: int, role: str, files: Sequence[str]) -> RankUpload:
    """Upload the files one rank wrote under ``<its local dir>/<role>``, then delete them from its node.

    Args:
        ckpt: The checkpoint.
        rank: The rank (selects its node folder).
        role: The role folder (``actor``, ``critic``).
        files: Names relative to the role folder, only those this rank wrote (others on the node are theirs).

    Raises:
        SyncError: an upload failed after its retries (nothing is deleted; the checkpoint gets no manifest).
    """
    from rlhf_ops.storage.rank_upload import upload_files

    local = ckpt.local_dir(rank)
    entries = upload_files(local, ckpt.remote_url, [f"{role}/{name}" for name in files])
    for entry in entries:  # the store holds them now; nothing reads a node's partial copy
        (local / entry.path).unlink()
    for folder in (local / role, local):
        try:
            folder.rmdir()
        except OSError:  # not empty: other ranks of this node (or the driver on its own node) write there too
            break
    return RankUpload(rank=rank, local_dir=str(local), files=entries)


@contextmanager
def _node_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of one node (node folders are local: ``flock`` holds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch_to_node(ckpt: NodeCheckpoint, *, rank: int) -> Path:
    """This rank's local copy of the remote checkpoint, downloaded (and verified) once per node folder.

    A complete local copy whose manifest equals the remote one is used as it is (another rank of the node, or
    the driver on its own node, fetched it); anything else is replaced by a verified download.
    """
    from rlhf_ops.storage import download_checkpoint, open_store, redact_url

    dest = ckpt.local_dir(rank)
    with _node_lock(dest.parent / f".{dest.name}.fetch.lock"):
        fs, path = open_store(ckpt.remote_url)
        remote = read_manifest(path, fs=fs)
        if is_complete(dest) and read_manifest(dest) == remote:
            return dest
        log.info("rank %d: downloading %s -> %s", rank, redact_url(ckpt.remote_url), dest)
        download_checkpoint(ckpt.remote_url, dest, overwrite=True)
    return dest
