"""Airflow reads its home and DB settings at import: configure a throw-away home before any test imports it.

The DAG files import ``rlhf_airflow.pipeline`` from the DAGs folder, which Airflow puts on ``sys.path`` when it parses
the folder; the tests that import it directly get the same path here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.airflow_env import configure_airflow_env

configure_airflow_env()
DAGS_DIR = Path(__file__).resolve().parents[3] / "dags"
if str(DAGS_DIR) not in sys.path:
    sys.path.append(str(DAGS_DIR))
