"""Finding a run's committed checkpoints and their eval reports, locally or on the remote store.

A checkpoint counts once its ``MANIFEST.json`` is there (the trainer writes it last, and the remote sync
uploads it after every file). Its evaluation writes ``eval.json`` into the same ``global_step_<N>/`` folder
(not listed in the manifest, so it never changes what the checkpoint is) locally and on the remote store.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.storage.manifest import is_complete, list_steps, step_dir_name

log = logging.getLogger(__name__)

EVAL_FILE = "eval.json"


def find_checkpoint(step: int, layout: RunLayout, *, local: bool = True) -> str | None:
    """Path (local) or URL (remote) of committed checkpoint ``step``, or None while it is not committed.

    The local folder wins when it is complete (nothing to download); else the remote store is asked. ``local``
    False asks only the remote store (a caller that does not share the cluster's disk).
    """
    folder = Path(layout.local_run_dir) / step_dir_name(step)
    if local and folder.is_dir() and is_complete(folder):
        return str(folder)
    if layout.remote_run_url:
        from rlhf_ops.storage import open_store

        url = f"{layout.remote_run_url}/{step_dir_name(step)}"
        fs, path = open_store(url)
        fs.invalidate_cache()
        if is_complete(path, fs=fs):
            return url
    return None


def local_checkpoint(step: int, layout: RunLayout, location: str) -> Path:
    """A local folder holding checkpoint ``step``: ``location`` itself, or a verified download of it."""
    if "://" not in location or location.startswith("file://"):
        return Path(location.removeprefix("file://"))
    from rlhf_ops.storage import download_checkpoint

    dest = Path(layout.cache_dir) / step_dir_name(step)
    if dest.is_dir() and is_complete(dest):
        return dest
    log.info("downloading %s -> %s", location, dest)
    download_checkpoint(location, dest, overwrite=True)
    return dest


def write_eval_report(report: dict[str, Any], *, step: int, local_dir: Path, layout: RunLayout) -> list[str]:
    """Write ``eval.json`` beside the checkpoint: in ``local_dir`` and in the remote folder; returns where."""
    text = json.dumps(report, indent=2, sort_keys=True, default=str) + "\n"
    places = []
    path = local_dir / EVAL_FILE
    path.write_text(text)
    places.append(str(path))
    local_run_ckpt = Path(layout.local_run_dir) / step_dir_name(step)
    if local_run_ckpt.is_dir() and local_run_ckpt.resolve() != local_dir.resolve():
        (local_run_ckpt / EVAL_FILE).write_text(text)  # evaluated from a download: also beside the original
        places.append(str(local_run_ckpt / EVAL_FILE))
    if layout.remote_run_url:
        from rlhf_ops.storage import open_store

        url = f"{layout.remote_run_url}/{step_dir_name(step)}/{EVAL_FILE}"
        fs, remote_path = open_store(url)
        fs.pipe_file(remote_path, text.encode())
        places.append(url)
    return places


def _read_report(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        with fs.open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("%s is not valid JSON; ignoring it", path)
        return None
    return data if isinstance(data, dict) else None


def collect_eval_reports(layout: RunLayout) -> dict[int, dict[str, Any]]:
    """``{step: eval report}`` of every evaluated checkpoint, local reports first, then remote ones."""
    from fsspec.implementations.local import LocalFileSystem

    reports: dict[int, dict[str, Any]] = {}
    local_fs = LocalFileSystem()
    for step in list_steps(layout.local_run_dir):
        report = _read_report(local_fs, str(Path(layout.local_run_dir) / step_dir_name(step) / EVAL_FILE))
        if report is not None:
            reports[step] = report
    if layout.remote_run_url:
        from rlhf_ops.storage import open_store

        fs, root = open_store(layout.remote_run_url)
        for step in list_steps(root, fs=fs):
            if step not in reports:
                report = _read_report(fs, f"{root}/{step_dir_name(step)}/{EVAL_FILE}")
                if report is not None:
                    reports[step] = report
    return reports


def best_step(reports: dict[int, dict[str, Any]], metric: str, *, higher_is_better: bool = True) -> int | None:
    """The step whose report has the best finite ``metrics[metric]``; ties go to the later step.

    Raises:
        ValueError: reports exist but none has ``metric`` (a typo in ``eval_metric``).
    """
    scored = []
    for step, report in reports.items():
        value = (report.get("metrics") or {}).get(metric)
        if isinstance(value, int | float) and math.isfinite(value):
            scored.append((value if higher_is_better else -value, step))
    if not scored and reports:
        known = sorted({k for r in reports.values() for k in (r.get("metrics") or {})})
        raise ValueError(f"eval_metric={metric!r} is in no eval report; use one of {known}")
    return max(scored)[1] if scored else None


TRAIN_DONE_STATES = frozenset({"success"})
TRAIN_FAILED_STATES = frozenset({"failed", "upstream_failed", "removed"})


class CheckpointNeverCommitted(RuntimeError):
    """Training ended without committing the awaited checkpoint."""


class CheckpointNotTrained(CheckpointNeverCommitted):
    """Training stopped early (``trainer.early_stop``) before the awaited step: nothing to evaluate, not a failure."""

    def __init__(self, message: str, *, stopped_step: int) -> None:
        super().__init__(message)
        self.stopped_step = stopped_step


def early_stop_step(layout: RunLayout, *, local: bool = True) -> int | None:
    """The step an early-stopped run ended at (its outcome file, local or remote), or None."""
    from rlhf_ops.trainer.early_stop import EARLY_STOPPED, read_outcome

    places = []
    if local:
        from fsspec.implementations.local import LocalFileSystem

        places.append((LocalFileSystem(), layout.local_run_dir))
    if layout.remote_run_url:
        from rlhf_ops.storage import open_store

        places.append(open_store(layout.remote_run_url))
    for fs, root in places:
        outcome = read_outcome(fs, root)
        if outcome is not None and outcome.get("outcome") == EARLY_STOPPED:
            return int(outcome["step"])
    return None


def checkpoint_ready(step: int, layout: RunLayout, *, train_state: str | None, local: bool = True) -> str | None:
    """Where checkpoint ``step`` is, or None to keep waiting.

    Args:
        step: The awaited global step.
        layout: The run's layout.
        train_state: The Airflow state of the training task (``None`` before it was scheduled).
        local: Look in the local run folder too (False: only the remote store, for a caller off the cluster).

    Raises:
        CheckpointNeverCommitted: training succeeded (or failed for good) and the checkpoint is not there.
    """
    found = find_checkpoint(step, layout, local=local)
    if found is not None:
        return found
    if train_state in TRAIN_DONE_STATES or train_state in TRAIN_FAILED_STATES:
        # A finished job has waited for its uploads, so a missing checkpoint will not appear any more.
        stopped = early_stop_step(layout, local=local) if train_state in TRAIN_DONE_STATES else None
        if stopped is not None and step > stopped:
            raise CheckpointNotTrained(
                f"training stopped early at step {stopped} (trainer.early_stop), before {step}", stopped_step=stopped
            )
        raise CheckpointNeverCommitted(
            f"training is {train_state} and global_step_{step} was never committed under {layout.checkpoint_url}"
        )
    return None


def awaited_checkpoint(
    step: int, layout: RunLayout, *, planned: list[int], train_state: str | None, local: bool = True
) -> tuple[int, str] | None:
    """The checkpoint the evaluation planned at ``step`` evaluates, as ``(step, where)``, or None to keep waiting.

    Normally checkpoint ``step`` itself. When training stopped early (a validation rule or the time budget) at a
    step the plan did not hold, the trainer still committed that step: the first planned evaluation after it
    evaluates it, so the run's last model is evaluated and can be registered; later planned ones are skipped.

    Raises:
        CheckpointNotTrained: the run stopped before ``step`` and another evaluation covers what it saved.
        CheckpointNeverCommitted: training ended and the checkpoint is not there.
    """
    try:
        found = checkpoint_ready(step, layout, train_state=train_state, local=local)
    except CheckpointNotTrained as exc:
        stopped = exc.stopped_step
        if stopped not in planned and step == min(p for p in [*planned, step] if p > stopped):
            where = find_checkpoint(stopped, layout, local=local)
            if where is not None:
                return stopped, where
        raise
    return None if found is None else (step, found)
