"""One Airflow DAG per YAML spec in ``dags/specs/``: adding a weekly RLHF run is adding a file.

Parsing reads the YAML files only (``rlhf_airflow.pipeline.specs``); see that module for the spec's keys and
``dags/specs/tiny_cpu_weekly.yaml`` for an example that runs on a laptop.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG

from rlhf_airflow.pipeline.specs import load_spec_dags

SPEC_DIR = Path(__file__).parent / "specs"

_dags: dict[str, DAG] = load_spec_dags(SPEC_DIR)
globals().update(_dags)  # Airflow collects the DAG objects found in the module's globals
