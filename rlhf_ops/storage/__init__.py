"""Checkpoint storage on fsspec stores (``file://``, ``s3://``, ``hdfs://``, ``webhdfs://``).

- ``manifest``: the commit marker of a checkpoint (``MANIFEST.json``), the ``latest`` pointer, retention.

- ``open_store``: URL (+ storage options) to ``(fs, root)``; where credentials come from.
- ``sync_checkpoint`` / ``sync_run_dir``: upload committed checkpoints (files, then manifest, then ``latest``),
  in parallel, incrementally, with retries; ``BackgroundSyncer`` does it from a thread with back-pressure.
- ``download_checkpoint``: fetch, verify against the manifest, and place in one rename.
- ``find_latest_remote`` / ``apply_remote_retention``: resume and retention on a remote run folder.
"""

from __future__ import annotations

from rlhf_ops.storage.background import BackgroundSyncer
from rlhf_ops.storage.download import download_checkpoint
from rlhf_ops.storage.manifest import CorruptCheckpointError
from rlhf_ops.storage.retry import RetryPolicy, call_with_retries, is_retryable
from rlhf_ops.storage.stores import SUPPORTED_SCHEMES, open_store, redact_url
from rlhf_ops.storage.sync import (
    RunSyncReport,
    SyncError,
    SyncReport,
    apply_remote_retention,
    find_latest_remote,
    sync_checkpoint,
    sync_run_dir,
)

__all__ = [
    "SUPPORTED_SCHEMES",
    "BackgroundSyncer",
    "CorruptCheckpointError",
    "RetryPolicy",
    "RunSyncReport",
    "SyncError",
    "SyncReport",
    "apply_remote_retention",
    "call_with_retries",
    "download_checkpoint",
    "find_latest_remote",
    "is_retryable",
    "open_store",
    "redact_url",
    "sync_checkpoint",
    "sync_run_dir",
]
