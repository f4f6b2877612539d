"""The ``sync_and_retain`` task: final sync of the run folder, then keep the last K checkpoints and the best.

The trainer already uploads each checkpoint in the background and waits for the uploads before it exits;
the final sync is the safety net that finishes any upload a crashed attempt left behind (files, then
manifest, then ``latest``: an incomplete remote checkpoint never looks complete). Retention runs after
every checkpoint was evaluated, so "best" is known: the best checkpoint by the eval metric is never deleted,
locally or remotely, and neither is the newest one.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from rlhf_ops.pipeline.checkpoints import best_step, collect_eval_reports
from rlhf_ops.pipeline.layout import RunLayout
from rlhf_ops.pipeline.promotion import PromotionSpec, choose_checkpoint

log = logging.getLogger(__name__)


def sync_and_retain(
    layout: RunLayout,
    *,
    keep_last: int,
    metric: str,
    higher_is_better: bool = True,
    promotion: PromotionSpec | None = None,
) -> dict[str, Any]:
    """Sync the local run folder to the remote store, then apply retention on both, protecting the best step.

    Args:
        layout: The run's layout.
        keep_last: Checkpoints to keep besides the best (0 keeps every one).
        metric: Eval metric that picks the best checkpoint (``eval.json``'s ``metrics``).
        higher_is_better: Direction of ``metric``.
        promotion: The promotion spec: then the best is the checkpoint it chooses (the one ``register_model``
            registers), not the top value of ``metric``.

    Returns:
        ``{"best_step", "best_value", "synced_steps", "deleted_local", "deleted_remote"}``.
    """
    from rlhf_ops.storage import apply_remote_retention, sync_run_dir
    from rlhf_ops.storage.manifest import apply_retention

    local = Path(layout.local_run_dir)
    synced: list[int] = []
    if layout.remote_run_url and local.is_dir():
        report = sync_run_dir(local, layout.remote_run_url)
        synced = [r.step for r in report.reports]
    reports = collect_eval_reports(layout)
    best = best_step(reports, metric, higher_is_better=higher_is_better)
    if promotion is not None and reports:  # the checkpoint register_model will register (a paired win)
        best, _ = choose_checkpoint(reports, promotion, metric=promotion.metric_name(metric))
    protect = {best} if best is not None else set()
    deleted_local = apply_retention(local, keep_last=keep_last, protect=protect) if local.is_dir() else []
    for step in deleted_local:  # exports of deleted checkpoints go too
        shutil.rmtree(layout.export_dir(step), ignore_errors=True)
    deleted_remote: list[int] = []
    if layout.remote_run_url:
        deleted_remote = apply_remote_retention(layout.remote_run_url, keep_last=keep_last, protect=protect)
    value = reports[best]["metrics"][metric] if best is not None else None
    log.info("best %s=%s at step %s; deleted local %s, remote %s", metric, value, best, deleted_local, deleted_remote)
    return {
        "best_step": best,
        "best_value": value,
        "synced_steps": synced,
        "deleted_local": deleted_local,
        "deleted_remote": deleted_remote,
    }
