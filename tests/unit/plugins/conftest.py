"""Airflow reads its home and DB settings at import: configure a throw-away home before any test imports it."""

from __future__ import annotations

from tests.support.airflow_env import configure_airflow_env

configure_airflow_env()
