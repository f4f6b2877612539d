"""Sync checkpoints to a remote store from a background thread while training goes on.

Back-pressure: the queue holds at most ``max_queue`` checkpoints waiting behind the one being uploaded.
When it is full, ``submit`` blocks until the uploader takes the next one (or raises ``TimeoutError``
after ``timeout``): training slows down to the speed of the remote store instead of piling up
unsynced checkpoints on local disk, which retention could then not delete safely.

Errors are never swallowed: each failed sync is logged when it happens and raised, all together as one
``SyncError``, by the next ``flush`` or ``close``. Uploads still waiting when the process exits without
``close`` are lost; the remote then lacks those checkpoints' manifests, so they are incomplete, never
corrupt, and ``sync_run_dir`` finishes them later.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlhf_ops.storage.stores import redact_url, scrub_secrets
from rlhf_ops.storage.sync import SyncError, SyncReport, apply_remote_retention, sync_checkpoint

logger = logging.getLogger(__name__)

_STOP = object()


class BackgroundSyncer:
    """One uploader thread fed by a bounded queue of local checkpoint folders.

    Example::

        with BackgroundSyncer("s3://bucket/exp/run", max_queue=2) as syncer:
            for step in ...:
                ...  # save, write_manifest, update_latest
                syncer.submit(ckpt_dir)
        # leaving the block waits for every upload and raises SyncError if any failed
    """

    def __init__(
        self,
        remote_run_url: str,
        *,
        max_queue: int = 2,
        keep_last: int | None = None,
        protect: Callable[[], Iterable[int]] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **sync_options: Any,
    ) -> None:
        """Start the uploader thread.

        Args:
            remote_run_url: the remote run folder.
            max_queue: checkpoints that may wait behind the one uploading before ``submit`` blocks.
            keep_last: after each successful sync, apply remote retention keeping this many (``None``: never).
            protect: returns the steps retention must keep (e.g. the best so far); called after each sync.
            storage_options: fsspec options (credentials, endpoint).
            **sync_options: other keyword arguments of ``sync_checkpoint`` (``max_workers``, ``retries``...).
        """
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        inspect.signature(sync_checkpoint).bind(None, None, **sync_options)  # unknown option: TypeError now
        self._url = remote_run_url
        self._keep_last = keep_last
        self._protect = protect
        self._options = {**sync_options, "storage_options": storage_options}
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._cond = threading.Condition()
        self._pending = 0
        self._errors: list[tuple[str, BaseException]] = []
        self._reports: list[SyncReport] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-syncer", daemon=True)
        self._thread.start()

    @property
    def reports(self) -> list[SyncReport]:
        """Reports of the syncs finished so far."""
        with self._cond:
            return list(self._reports)

    def submit(self, local_ckpt_dir: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        """Queue a committed local checkpoint; blocks while the queue is full (see the module docstring).

        Raises:
            TimeoutError: the queue stayed full for ``timeout`` seconds.
            RuntimeError: the syncer is closed.
        """
        if self._closed:
            raise RuntimeError("BackgroundSyncer is closed; create a new one")
        with self._cond:
            self._pending += 1
        try:
            self._queue.put(os.fspath(local_ckpt_dir), timeout=timeout)
        except queue.Full:
            with self._cond:
                self._pending -= 1
            raise TimeoutError(
                f"sync queue still full after {timeout}s; the remote store is slower than training"
            ) from None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted checkpoint is synced, then raise the errors collected so far.

        Raises:
            TimeoutError: uploads were still running after ``timeout`` seconds.
            SyncError: one or more syncs failed (all are listed; the first is the ``__cause__``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self._pending} checkpoint sync(s) still running after {timeout}s")
                self._cond.wait(left)
        self._raise_errors()

    def close(self, timeout: float | None = None) -> None:
        """Finish queued uploads, stop the thread, and raise collected errors (like ``flush``)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)  # behind every queued checkpoint
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint syncs still running after {timeout}s")
        self._raise_errors()

    def __enter__(self) -> BackgroundSyncer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def raise_errors(self) -> None:
        """Raise the errors of the syncs failed so far (as ``flush`` does) without waiting for running ones."""
        self._raise_errors()

    def _raise_errors(self) -> None:
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            failed = {path: error for path, error in errors}
            lines = "; ".join(f"{path}: {type(err).__name__}: {scrub_secrets(str(err))}" for path, err in errors)
            message = f"{len(errors)} background checkpoint sync(s) to {redact_url(self._url)} failed: {lines}"
            raise SyncError(message, failed=failed) from errors[0][1]

    def _sync(self, path: str) -> None:
        report = sync_checkpoint(path, self._url, **self._options)
        with self._cond:
            self._reports.append(report)
        if self._keep_last is not None:
            protect = set(self._protect()) if self._protect is not None else set()
            storage_options = self._options["storage_options"]
            apply_remote_retention(
                self._url, keep_last=self._keep_last, protect=protect, storage_options=storage_options
            )

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            path = str(item)
            try:
                self._sync(path)
            except Exception as exc:  # collected and raised by flush/close
                logger.error("background sync of %s failed: %s", path, scrub_secrets(str(exc)))
                with self._cond:
                    self._errors.append((path, exc))
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
