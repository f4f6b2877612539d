"""Run inside a foreign Airflow venv (``tests/support/foreign_stack.py``): standalone, it imports only Airflow and
the installed provider, never this repository's tests or sources.

    python foreign_airflow_run.py inspect DAGS_DIR      # provider, `ray` hook, plugin, DAG import errors, torch?
    python foreign_airflow_run.py test-connection       # the `ray_default` connection's Test button
    python foreign_airflow_run.py hook-meta             # the `ray` connection form, as the UI receives it
    python foreign_airflow_run.py dag-test DAGS_DIR CONF_JSON   # rlhf_ppo through dag.test(), task states

Prints one JSON object on the last line of stdout. AIRFLOW_HOME and the connections come from the environment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HEAVY = ("torch", "transformers", "vllm")


def _dagbag_module() -> Any:
    try:  # Airflow 3.2+
        from airflow.dag_processing import dagbag
    except ImportError:  # Airflow 3.1
        from airflow.models import dagbag  # type: ignore[no-redef,unused-ignore]
    return dagbag


def _dagbag(folder: str) -> Any:
    module = _dagbag_module()
    try:  # Airflow 3.2+ names the bundle
        return module.BundleDagBag(dag_folder=folder, bundle_path=Path(folder), bundle_name="dags-folder")
    except TypeError:  # Airflow 3.1
        return module.BundleDagBag(dag_folder=folder, bundle_path=Path(folder))


def inspect(folder: str) -> dict[str, Any]:
    """What the providers manager, the plugins manager and a DAG parse see of the provider."""
    import airflow
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    hook = manager.hooks.get("ray")
    manager.initialize_providers_plugins()
    import rlhf_airflow.hooks

    bag = _dagbag(folder)
    return {
        "airflow": airflow.__version__,
        "providers": {name: info.version for name, info in manager.providers.items()},
        "ray_hook": None if hook is None else [hook.hook_class_name, hook.hook_name, hook.connection_testable],
        "ui_field_behaviour": rlhf_airflow.hooks.RayJobHook.get_ui_field_behaviour(),
        "plugins": [plugin.name for plugin in manager.plugins],
        "dags": sorted(bag.dag_ids),
        "import_errors": {str(k): str(v)[-400:] for k, v in bag.import_errors.items()},
        "heavy_modules": [m for m in HEAVY if m in sys.modules],
    }


def hook_meta() -> dict[str, Any]:
    """The ``ray`` entry of what the API server sends the connection form (``GET /ui/connections/hook_meta``).

    A fresh process: Airflow 3.1 builds it from the hooks' ``get_connection_form_widgets`` with WTForms and FAB
    stood in for when they are not installed, 3.2+ from the provider info's ``conn-fields``.
    """
    from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService

    entry = next((m for m in HookMetaService.hook_meta_data() if m.connection_type == "ray"), None)
    return {"ray": None if entry is None else entry.model_dump(mode="json")}


def test_connection() -> dict[str, Any]:
    """The `ray_default` connection's Test button, as the API server runs it."""
    from rlhf_airflow.hooks import RayJobHook

    ok, message = RayJobHook("ray_default").test_connection()
    return {"ok": ok, "message": message}


def dag_test(folder: str, conf: dict[str, Any]) -> dict[str, Any]:
    """Run ``rlhf_ppo`` once with ``dag.test()``; the task states and whether the process imported torch."""
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    bag = _dagbag(folder)
    if bag.import_errors:
        return {"import_errors": {str(k): str(v)[-800:] for k, v in bag.import_errors.items()}}
    from airflow.dag_processing.bundles.manager import DagBundlesManager

    # The DAG must be known to the metadata DB (its bundle row first), as the dag processor would leave it.
    DagBundlesManager().sync_bundles_to_db()
    _dagbag_module().sync_bag_to_db(bag, "dags-folder", None)
    dag_run = bag.dags["rlhf_ppo"].test(run_conf=conf)
    with create_session() as session:
        rows = session.query(TaskInstance).filter(TaskInstance.run_id == dag_run.run_id).all()
        states = {f"{ti.task_id}[{ti.map_index}]": str(ti.state) for ti in rows}
    return {
        "state": str(dag_run.state),
        "run_id": dag_run.run_id,
        "states": states,
        "heavy_modules": [m for m in HEAVY if m in sys.modules],
    }


def main(argv: list[str]) -> int:
    """Dispatch on the first argument; print the result as JSON on the last line."""
    mode = argv[0]
    if mode == "inspect":
        result = inspect(argv[1])
    elif mode == "hook-meta":
        result = hook_meta()
    elif mode == "test-connection":
        result = test_connection()
    elif mode == "dag-test":
        result = dag_test(argv[1], json.loads(argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}: inspect, hook-meta, test-connection or dag-test")
    print("\n" + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
