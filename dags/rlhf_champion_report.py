"""``rlhf_champion_report``: runs once per new champion of ``rlhf_ppo`` (scheduled on its ``champion`` Asset).

The downstream side of the pipeline's Assets: ``promote_champion`` emits an event on ``rlhf_ppo.champion`` only
when the alias moved, with the version, model URI, decision and MLflow run in the event's extra. This DAG writes
a champion card (``<RLHF_WORK_DIR>/champions/<registered name>/v<version>.json``) from it: the place to hang an
export, a smoke test or a deployment on a new champion.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from rlhf_airflow.pipeline.assets import pipeline_asset

with DAG(
    "rlhf_champion_report",
    schedule=[pipeline_asset("rlhf_ppo", "champion")],
    start_date=pendulum.datetime(2025, 1, 1, tz="UTC"),
    catchup=False,
    default_args={"owner": "rlhf-platform", "retries": 2, "retry_delay": pendulum.duration(seconds=30)},
    tags=["rlhf", "downstream"],
    description="A champion card for each new champion of rlhf_ppo",
    doc_md=__doc__,
) as dag:

    @task
    def champion_card(**context: object) -> list[str]:
        """One card per triggering champion event (idempotent: the same version writes the same file)."""
        import json
        import os
        from pathlib import Path

        events = context["triggering_asset_events"]
        root = Path(os.environ.get("RLHF_WORK_DIR", "rlhf-work")) / "champions"
        written = []
        for asset_events in events.values():  # type: ignore[attr-defined]
            for event in asset_events:
                extra = dict(event.extra or {})
                card = {**extra, "asset": event.asset.name, "emitted_at": str(event.timestamp)}
                path = root / str(extra.get("registered_name", "model")) / f"v{extra.get('version', 'unknown')}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(card, indent=2, sort_keys=True, default=str) + "\n")
                written.append(str(path))
        return written

    champion_card()
