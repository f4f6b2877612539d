"""``get_provider_info``: what Airflow's providers manager reads from the ``apache_airflow_provider`` entry point.

It declares the ``ray`` connection type (hook, form fields, field behaviour: Airflow 3.2+ reads them from here
without importing the hook; Airflow 3.1 asks the hook's own methods, which return the same), the extra links and
the plugin that registers them in the API server. Nothing heavy is imported: the providers manager calls this in
every Airflow process.
"""

from __future__ import annotations

from typing import Any

from rlhf_airflow.connection_form import CONN_FIELDS, UI_FIELD_BEHAVIOUR
from rlhf_airflow.versions import PROVIDER_DISTRIBUTION, installed

_LINKS = ("RayJobLink", "MlflowRunLink", "CheckpointFolderLink")


def get_provider_info() -> dict[str, Any]:
    """The provider's metadata (Airflow's provider_info schema, plus ``conn-fields`` / ``ui-field-behaviour``)."""
    return {
        "package-name": PROVIDER_DISTRIBUTION,
        "name": "RLHF on Ray",
        "description": "Run the RLHF pipeline's jobs (prepare, train, evaluate, register) on a Ray cluster.",
        "versions": [installed(PROVIDER_DISTRIBUTION) or "0.1.0"],
        "integrations": [
            {"integration-name": "Ray Jobs", "external-doc-url": "https://docs.ray.io/", "tags": ["software"]}
        ],
        "hooks": [{"integration-name": "Ray Jobs", "python-modules": ["rlhf_airflow.hooks"]}],
        "operators": [
            {"integration-name": "Ray Jobs", "python-modules": ["rlhf_airflow.operators", "rlhf_airflow.task_jobs"]}
        ],
        "triggers": [{"integration-name": "Ray Jobs", "python-modules": ["rlhf_airflow.triggers"]}],
        "connection-types": [
            {
                "connection-type": "ray",
                "hook-class-name": "rlhf_airflow.hooks.RayJobHook",
                "hook-name": "Ray Jobs",
                "conn-fields": CONN_FIELDS,
                "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
            }
        ],
        "extra-links": [f"rlhf_airflow.links.{name}" for name in _LINKS],
        "plugins": [{"name": "rlhf", "plugin-class": "rlhf_airflow.plugin.RlhfPlugin"}],
    }
