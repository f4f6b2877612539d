"""The ``ray`` connection's form (fields, labels, placeholders) and the check behind its *Test* button.

Airflow 3.2+ reads the form declaratively from the provider info (``CONN_FIELDS``, ``UI_FIELD_BEHAVIOUR``);
Airflow 3.1 asks the hook (``RayJobHook.get_connection_form_widgets`` / ``get_ui_field_behaviour``), which return
the same fields built from these definitions. :func:`probe_job_server` is what the *Test* button and the
pipeline's pre-flight run: one GET of the Jobs API's version endpoint, so a wrong host, a missing token or an
unsupported Ray release is one line naming what and the fix, before any job is submitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_airflow.versions import ray_problem

# Extra fields of the connection (``extra`` JSON keys), in the provider-info ``conn-fields`` format.
CONN_FIELDS: dict[str, dict[str, Any]] = {
    "verify": {
        "label": "TLS verify",
        "description": "true, false, or the path of a CA bundle (https dashboards only)",
        "schema": {"type": ["string", "null"], "default": "true"},
    },
    "headers": {
        "label": "Extra HTTP headers (JSON)",
        "description": 'e.g. {"X-Org": "ml"}; the password is sent as "Authorization: Bearer <password>"',
        "schema": {"type": ["string", "null"]},
    },
}

# Hidden fields, relabeling and placeholders, in the provider-info ``ui-field-behaviour`` format.
UI_FIELD_BEHAVIOUR: dict[str, Any] = {
    "hidden-fields": ["login"],
    "relabeling": {"host": "Ray dashboard host", "schema": "Scheme (http or https)", "password": "Ray auth token"},
    "placeholders": {
        "host": "ray-head.ray.svc (or http://ray-head:8265)",
        "port": "8265",
        "schema": "http",
        "password": "the cluster's RAY_AUTH_TOKEN, if token auth is on",
        "verify": "true",
        "headers": "{}",
    },
}

VERSION_PATH = "/api/version"
TIMEOUT_S = 10.0


def form_widgets() -> dict[str, Any]:
    """``CONN_FIELDS`` as the wtforms fields Airflow 3.1's connection form takes (needs Flask-AppBuilder)."""
    from flask_appbuilder.fieldwidgets import BS3TextFieldWidget
    from wtforms import StringField

    return {
        name: StringField(field["label"], widget=BS3TextFieldWidget(), description=field["description"])
        for name, field in CONN_FIELDS.items()
    }


def field_behaviour() -> dict[str, Any]:
    """``UI_FIELD_BEHAVIOUR`` in the hook method's format (snake_case keys), for Airflow 3.1."""
    return {
        "hidden_fields": list(UI_FIELD_BEHAVIOUR["hidden-fields"]),
        "relabeling": dict(UI_FIELD_BEHAVIOUR["relabeling"]),
        "placeholders": dict(UI_FIELD_BEHAVIOUR["placeholders"]),
    }


def probe_job_server(address: str, headers: Mapping[str, str], verify: bool | str) -> tuple[bool, str]:
    """Ask the Ray job server at ``address`` for its version; ``(ok, one-line message)``.

    A failure names what went wrong and the fix (host/port, token, TLS, Ray release); it never raises.
    """
    import requests

    url = f"{address.rstrip('/')}{VERSION_PATH}"
    try:
        response = requests.get(url, headers=dict(headers), verify=verify, timeout=TIMEOUT_S)
    except requests.exceptions.SSLError as exc:
        return False, f"TLS to the Ray job server at {address} failed ({exc}); set extra verify to a CA bundle path"
    except requests.RequestException as exc:
        return False, (
            f"the Ray job server at {address} does not answer ({type(exc).__name__}); check the connection's host "
            "and port (the Ray dashboard, usually 8265) and that the cluster is running"
        )
    if response.status_code in (401, 403):
        return False, (
            f"the Ray job server at {address} refused the request (HTTP {response.status_code}); set the "
            "connection's password to the cluster's auth token"
        )
    if response.status_code != 200:
        return False, (
            f"{url} answered HTTP {response.status_code}; point the connection at the Ray dashboard "
            "(http(s)://<head>:8265), not the Ray client or GCS port"
        )
    try:
        ray_version = str(response.json().get("ray_version") or "")
    except ValueError:
        ray_version = ""
    if problem := ray_problem(ray_version, where=address):
        return False, problem
    return True, f"Ray {ray_version} job server at {address}"
