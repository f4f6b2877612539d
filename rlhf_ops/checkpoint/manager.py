"""The controller's checkpoint policy: save (commit rule), retention, background sync, resume.

A save writes every role's shards (collective on the workers), the HF export ``hf/`` when asked for
(from the driver, reading the actor's shards), then ``trainer_state.json``, then ``MANIFEST.json``, then
``latest``; only then is the checkpoint handed to the background syncer.
Resume picks the newest complete checkpoint, local or remote (``resume_mode=auto``), or the one
named by ``resume_mode``, verifies it against its manifest, and loads it.

Without a shared filesystem (``node_run_dir``, ``trainer.shared_checkpoint_root=false``) the same rule is split
across nodes: each rank writes its shards on its own node and uploads them to the store; the driver uploads
``trainer_state.json`` and writes the remote ``MANIFEST.json`` and ``latest`` only after every rank's upload
returned (:mod:`rlhf_ops.storage.rank_upload`). Nothing is kept on the driver's disk. Resume downloads the
newest remote checkpoint on the driver (verified) and on every node (:mod:`rlhf_ops.checkpoint.node_local`).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rlhf_ops.checkpoint.node_local import NodeCheckpoint, RankUpload
from rlhf_ops.storage.manifest import CorruptCheckpointError as CorruptCheckpointError
from rlhf_ops.storage.manifest import (
    FileEntry,
    apply_retention,
    find_latest_complete,
    is_complete,
    step_dir_name,
    update_latest,
    verify_checkpoint,
    write_manifest,
)

log = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, quota, permissions); the message names the folder."""


TRAINER_STATE_FILE = "trainer_state.json"
HF_EXPORT_DIR = "hf"


class _Role(Protocol):
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...
    def save_checkpoint_to_store(self, ckpt: NodeCheckpoint, role: str) -> list[RankUpload]: ...
    def load_checkpoint_from_store(self, ckpt: NodeCheckpoint, role: str) -> None: ...


class _Trainer(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    """Checkpoints of one run folder ``<root>/<experiment>/<run>``.

    Args:
        run_dir: The local run folder (must be readable by every worker: a shared path on clusters).
        roles: ``{"actor": client, "critic": client}``; each saves under ``global_step_<N>/<name>``.
        remote_url: Remote run folder (``s3://…/<experiment>/<run>``) or None.
        keep_last: Keep this many complete checkpoints locally and remotely (0 = all).
        resume_mode: ``auto``, ``disable`` or a checkpoint path / URL.
        storage_options: fsspec options for the remote store (credentials never come from config).
        on_commit: Called with ``(step, local_dir)`` after each local commit (events, eval triggers).
        hf_base_model_path: When set (``trainer.save_hf_model``), each save also writes ``<ckpt>/hf/``, an HF
            model folder of the actor built on this base model's config and tokenizer.
        node_run_dir: No shared filesystem: the run folder on each rank's node (``{rank}`` becomes the rank);
            saves go from the ranks to ``remote_url`` (required) and nothing is written into ``run_dir`` but
            resumed checkpoints.
        store_retries: Retries of a failed store transfer (``trainer.store_retries``); after them the next
            save (or ``finish``) fails naming the store, and the failed checkpoint never gets a remote manifest.
        store_backoff_s: Base of the backoff between those retries.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        roles: dict[str, _Role],
        remote_url: str | None = None,
        keep_last: int = 0,
        resume_mode: str = "auto",
        storage_options: dict[str, Any] | None = None,
        on_commit: Callable[[int, str], None] | None = None,
        hf_base_model_path: str | None = None,
        node_run_dir: str | None = None,
        store_retries: int = 5,
        store_backoff_s: float = 0.5,
    ) -> None:
        if node_run_dir is not None and (not remote_url or hf_base_model_path is not None):
            raise ValueError(
                "checkpoints without a shared filesystem (node_run_dir) need remote_url and no HF export at save; "
                "set trainer.remote_store_url and trainer.save_hf_model=false"
            )
        self.run_dir = Path(run_dir)
        self.roles, self.remote_url, self.keep_last = roles, remote_url, keep_last
        self.resume_mode, self.storage_options, self.on_commit = resume_mode, storage_options, on_commit
        self.hf_base_model_path, self.node_run_dir = hf_base_model_path, node_run_dir
        self.best_step: int | None = None
        self.saved_steps: list[int] = []
        self._syncer = None
        if remote_url and node_run_dir is None:  # without a shared filesystem the save itself uploads
            from rlhf_ops.storage import BackgroundSyncer

            self._syncer = BackgroundSyncer(
                remote_url,
                max_queue=2,
                keep_last=keep_last or None,
                protect=lambda: [s for s in [self.best_step] if s is not None],
                storage_options=storage_options,
                retries=store_retries,
                backoff_s=store_backoff_s,
            )

    def step_dir(self, step: int) -> Path:
        return self.run_dir / step_dir_name(step)

    # ---- save ---------------------------------------------------------------------------------
    def save(self, trainer: _Trainer) -> Path | str:
        """Commits a checkpoint of every role and ``trainer``; its local folder, or its URL without a shared root."""
        if self._syncer is not None:  # an upload that failed after its retries ends the run now, naming the store
            self._syncer.raise_errors()
        state = trainer.state_dict()
        step = int(state["global_step"])
        if self.node_run_dir is not None:
            return self._save_to_store(state, step)
        ckpt = self.step_dir(step)
        try:
            self._write(ckpt, state, step)
        except OSError as exc:  # a full disk, a quota, a read-only mount: the previous checkpoint stays the one
            (ckpt / "MANIFEST.json").unlink(missing_ok=True)  # first: a partial delete never looks complete
            shutil.rmtree(ckpt, ignore_errors=True)  # frees the space the partial checkpoint took
            previous = f"step {self.saved_steps[-1]}" if self.saved_steps else "none"
            reason = exc.strerror or (str(exc).strip().splitlines() or [type(exc).__name__])[-1]  # Ray: a traceback
            raise CheckpointWriteError(
                f"cannot write checkpoint {ckpt} ({reason}); the previous checkpoint ({previous}) and "
                f"{self.run_dir}/latest are unchanged. Fix: free space on (or write access to) {self.run_dir}, "
                "or set trainer.checkpoint_root / trainer.keep_last"
            ) from exc
        self.saved_steps.append(step)
        if self.keep_last:
            protect = {self.best_step} if self.best_step is not None else set()
            apply_retention(self.run_dir, keep_last=self.keep_last, protect=protect)
        if self._syncer is not None:
            self._syncer.submit(str(ckpt))
        if self.on_commit is not None:
            self.on_commit(step, str(ckpt))
        log.info("checkpoint committed: %s", ckpt)
        return ckpt

    def _write(self, ckpt: Path, state: dict[str, Any], step: int) -> None:
        """Shards, HF export, trainer state, manifest, then ``latest`` (the commit rule)."""
        if ckpt.exists():  # a leftover of a crash mid-save (or a re-save of the same step): start clean
            shutil.rmtree(ckpt)
        ckpt.mkdir(parents=True)
        for name, role in self.roles.items():
            role.save_checkpoint(str(ckpt / name))
        if self.hf_base_model_path is not None and "actor" in self.roles:
            from rlhf_ops.checkpoint.export import export_hf_model

            export_hf_model(ckpt, ckpt / HF_EXPORT_DIR, base_model_path=self.hf_base_model_path, verify=False)
        (ckpt / TRAINER_STATE_FILE).write_text(json.dumps(state))
        write_manifest(ckpt, step=step, extra={"roles": sorted(self.roles)})
        update_latest(self.run_dir, step)

    def _save_to_store(self, state: dict[str, Any], step: int) -> str:
        """Ranks upload their own shards, the driver its state, then the manifest and ``latest`` (the commit rule)."""
        from rlhf_ops.storage import apply_remote_retention, redact_url
        from rlhf_ops.storage.rank_upload import commit_remote_checkpoint, discard_remote_manifest, upload_files

        assert self.remote_url is not None and self.node_run_dir is not None
        url = "/".join([self.remote_url.rstrip("/"), step_dir_name(step)])
        node_ckpt = NodeCheckpoint(node_run_dir=self.node_run_dir, step_dir=step_dir_name(step), remote_url=url)
        options = self.storage_options
        discard_remote_manifest(url, storage_options=options)  # a step saved again: no manifest over new files
        files: list[FileEntry] = []
        for name, role in self.roles.items():
            for upload in role.save_checkpoint_to_store(node_ckpt, name):
                megabytes = sum(entry.size for entry in upload.files) / 1e6
                log.info(
                    "[%s] rank %d wrote %d file(s) (%.1f MB) in %s, uploaded",
                    name,
                    upload.rank,
                    len(upload.files),
                    megabytes,
                    upload.local_dir,
                )
                files += upload.files
        with tempfile.TemporaryDirectory(prefix="rlhf-trainer-state-") as staging:
            (Path(staging) / TRAINER_STATE_FILE).write_text(json.dumps(state))
            files += upload_files(staging, url, [TRAINER_STATE_FILE], storage_options=options)
        commit_remote_checkpoint(url, files, extra={"roles": sorted(self.roles)}, storage_options=options)
        self.saved_steps.append(step)
        if self.keep_last:
            protect = {self.best_step} if self.best_step is not None else set()
            apply_remote_retention(self.remote_url, keep_last=self.keep_last, protect=protect, storage_options=options)
        if self.on_commit is not None:
            self.on_commit(step, url)
        log.info("checkpoint committed: %s", redact_url(url))
        return url

    def finish(self) -> None:
        """Waits for every background upload; raises if one failed (nothing half-visible remotely)."""
        if self._syncer is not None:
            self._syncer.close()

    # ---- resume -------------------------------------------------------------------------------
    def _resolve(self) -> Path | None:
        mode = self.resume_mode
        if mode == "disable":
            return None
        if mode != "auto":
            return self._fetch_explicit(mode)
        local = find_latest_complete(self.run_dir) if self.run_dir.exists() else None
        remote = None
        if self.remote_url:
            from rlhf_ops.storage import find_latest_remote

            remote = find_latest_remote(self.remote_url, storage_options=self.storage_options)
        if remote is not None and (local is None or remote[0] > local[0]):
            return self._download(remote[1], remote[0])
        return Path(local[1]) if local is not None else None

    def _fetch_explicit(self, where: str) -> Path:
        if "://" in where and not where.startswith("file://"):
            from rlhf_ops.storage import open_store
            from rlhf_ops.storage.manifest import read_manifest

            fs, path = open_store(where, storage_options=self.storage_options)
            return self._download(where, read_manifest(path, fs=fs).step)
        local = Path(where.removeprefix("file://"))
        if not is_complete(local):
            raise ValueError(
                f"trainer.resume_mode: {where} is not a complete checkpoint (no MANIFEST.json); "
                "point it at a global_step_<N> folder, or use resume_mode=auto"
            )
        return local

    def _download(self, url: str, step: int) -> Path:
        from rlhf_ops.storage import download_checkpoint

        dest = self.step_dir(step)
        log.info("downloading checkpoint %s -> %s", url, dest)
        download_checkpoint(url, dest, overwrite=True, storage_options=self.storage_options)
        update_latest(self.run_dir, step)
        return dest

    def _resolve_remote(self) -> tuple[Path, str] | None:
        """Without a shared filesystem: the remote checkpoint to resume (downloaded here too) and its URL."""
        mode = self.resume_mode
        if mode == "disable":
            return None
        if mode != "auto":
            if "://" not in mode or mode.startswith("file://"):
                raise ValueError(
                    f"trainer.resume_mode: {mode} is a path on the driver's disk, which the ranks of other nodes "
                    "cannot read (trainer.shared_checkpoint_root=false); give the checkpoint's remote URL, or 'auto'"
                )
            return self._fetch_explicit(mode), mode
        from rlhf_ops.storage import find_latest_remote

        assert self.remote_url is not None
        remote = find_latest_remote(self.remote_url, storage_options=self.storage_options)
        return None if remote is None else (self._download(remote[1], remote[0]), remote[1])

    def maybe_resume(self, trainer: _Trainer) -> int | None:
        """Loads the checkpoint ``resume_mode`` selects; returns its step (None: fresh start)."""
        found = self._resolve_remote() if self.node_run_dir is not None else self._resolve()
        if found is None:
            return None
        ckpt, url = found if isinstance(found, tuple) else (found, None)
        problems = verify_checkpoint(ckpt)
        if problems:
            raise CorruptCheckpointError(str(ckpt), problems)
        for name, role in self.roles.items():
            if url is None:
                role.load_checkpoint(str(ckpt / name))
            else:  # each node loads its own copy of the remote checkpoint, in the folder named like the driver's
                assert self.node_run_dir is not None
                node_ckpt = NodeCheckpoint(node_run_dir=self.node_run_dir, step_dir=ckpt.name, remote_url=url)
                role.load_checkpoint_from_store(node_ckpt, name)
        state = json.loads((ckpt / TRAINER_STATE_FILE).read_text())
        trainer.load_state_dict(state)
        log.info("resumed from %s (step %d)", ckpt, state["global_step"])
        return int(state["global_step"])
