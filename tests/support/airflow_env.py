"""Point Airflow at a throw-away home and SQLite DB before anything imports ``airflow``.

Airflow reads ``AIRFLOW_HOME`` and its config when ``airflow`` is first imported, so call
:func:`configure_airflow_env` from a conftest at import time (not in a fixture that runs after test modules
were collected), then :func:`migrate_airflow_db` once per session for tests that need the metadata DB
(``dag.test()``, XCom/TaskInstance rows). Migrating a fresh SQLite DB takes ~4 s on this machine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

_MARKER = "_RLHF_TEST_AIRFLOW_HOME"


def configure_airflow_env(home: Path | None = None) -> Path:
    """Set the Airflow env vars for tests (idempotent) and return the Airflow home.

    Args:
        home: Folder for airflow.cfg, airflow.db and logs; default: a fresh temp dir removed at exit.

    If ``airflow`` was already imported (its settings are frozen), a warning is issued: tests that only need
    Airflow classes still work, but :func:`migrate_airflow_db` then refuses to run.
    """
    if existing := os.environ.get(_MARKER):
        return Path(existing)
    if "airflow" in sys.modules:
        warnings.warn(
            "airflow was imported before configure_airflow_env(); call it from the root conftest at import time",
            stacklevel=2,
        )
        os.environ["_RLHF_AIRFLOW_IMPORTED_EARLY"] = "1"
    if home is None:
        home = Path(tempfile.mkdtemp(prefix="rlhf_airflow_"))
        atexit.register(shutil.rmtree, home, ignore_errors=True)
    home = Path(home)
    (home / "dags").mkdir(parents=True, exist_ok=True)
    (home / "plugins").mkdir(parents=True, exist_ok=True)
    os.environ.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            _MARKER: str(home),
        }
    )
    return home


def migrate_airflow_db(timeout_s: float = 180.0) -> Path:
    """Run ``airflow db migrate`` once for the configured home (a marker file skips repeats); returns the DB path.

    Runs the CLI in a subprocess so this process's SQLAlchemy engine is created after the schema exists.
    """
    home = configure_airflow_env()
    if os.environ.get("_RLHF_AIRFLOW_IMPORTED_EARLY"):
        raise RuntimeError("airflow was imported before configure_airflow_env(); its DB settings point elsewhere")
    db, done = home / "airflow.db", home / ".migrated"
    if done.exists():
        return db
    airflow_cli = Path(sys.executable).with_name("airflow")
    result = subprocess.run(
        [str(airflow_cli), "db", "migrate"],
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    done.write_text("ok\n")
    return db
