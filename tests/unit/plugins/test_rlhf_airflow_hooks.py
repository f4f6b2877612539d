"""RayJobHook connection handling and job_env_from_connections (connections from AIRFLOW_CONN_* env vars)."""

from __future__ import annotations

import asyncio
import json

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException
from airflow.sdk.log import redact

from rlhf_airflow.hooks import RayJobHook, job_env_from_connections, merge_env_vars, normalize_dashboard_address


def _conn(monkeypatch: pytest.MonkeyPatch, conn_id: str, **fields: object) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields))


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8265/", "http://127.0.0.1:8265"),
        ("127.0.0.1:8265", "http://127.0.0.1:8265"),
        ("https://ray.example.com", "https://ray.example.com"),
    ],
)
def test_normalize_dashboard_address(given: str, expected: str) -> None:
    assert normalize_dashboard_address(given) == expected


@pytest.mark.parametrize("bad", ["", "ray://127.0.0.1:10001"])
def test_normalize_dashboard_address_rejects_non_http(bad: str) -> None:
    with pytest.raises(ValueError, match="ray_address"):
        normalize_dashboard_address(bad)


def test_client_config_from_connection_with_token(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(
        monkeypatch,
        "ray_cfg",
        conn_type="ray",
        host="10.0.0.5",
        port=8265,
        password="ray-token-0123456789",
        extra={"headers": json.dumps({"X-Team": "rl"}), "verify": "false"},
    )
    address, headers, verify = RayJobHook("ray_cfg").client_config()
    assert address == "http://10.0.0.5:8265"
    assert headers == {"X-Team": "rl", "Authorization": "Bearer ray-token-0123456789"}
    assert verify is False
    assert redact("token=ray-token-0123456789") == "token=***"  # the token is registered with the masker
    # The triggerer's path (async connection read) resolves the same client settings.
    assert asyncio.run(RayJobHook("ray_cfg").aclient_config()) == (address, headers, verify)


def test_explicit_authorization_header_wins_and_scheme_host_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(
        monkeypatch,
        "ray_hdr",
        conn_type="ray",
        host="https://ray.internal",
        port=443,
        password="ignored-token",
        extra={"headers": {"Authorization": "Basic abc"}, "verify": "/etc/ca.pem"},
    )
    address, headers, verify = RayJobHook("ray_hdr").client_config()
    assert (address, headers, verify) == ("https://ray.internal:443", {"Authorization": "Basic abc"}, "/etc/ca.pem")


def test_address_override_wins_and_connection_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(monkeypatch, "ray_ovr", conn_type="ray", host="10.0.0.5", port=8265)
    assert RayJobHook("ray_ovr", address="http://10.9.9.9:8265").dashboard_address == "http://10.9.9.9:8265"
    assert RayJobHook("no_such_conn", address="10.9.9.9:8265").dashboard_address == "http://10.9.9.9:8265"
    with pytest.raises(AirflowNotFoundException):
        RayJobHook("no_such_conn").client_config()


def test_connection_without_host_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(monkeypatch, "ray_nohost", conn_type="ray", port=8265)
    with pytest.raises(ValueError, match="has no host; set host to the Ray dashboard"):
        RayJobHook("ray_nohost").client_config()


def test_job_env_from_s3_and_mlflow_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(
        monkeypatch,
        "s3_test",
        conn_type="aws",
        login="AKIATESTKEY",
        password="s3-secret-value-42",
        extra={"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
    )
    _conn(monkeypatch, "mlflow_test", conn_type="http", host="mlflow", port=5000, login="bot", password="mlf-pass-77")
    env = job_env_from_connections(s3_conn_id="s3_test", mlflow_conn_id="mlflow_test")
    assert env == {
        "AWS_ACCESS_KEY_ID": "AKIATESTKEY",
        "AWS_SECRET_ACCESS_KEY": "s3-secret-value-42",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
        "FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_REGION": "eu-west-1",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "MLFLOW_TRACKING_USERNAME": "bot",
        "MLFLOW_TRACKING_PASSWORD": "mlf-pass-77",
    }
    assert redact(f"{env['AWS_SECRET_ACCESS_KEY']} {env['MLFLOW_TRACKING_PASSWORD']}") == "*** ***"
    assert job_env_from_connections() == {}


def test_merge_env_vars_overrides_and_validates() -> None:
    runtime_env = {"pip": ["x"], "env_vars": {"A": "1", "B": "2"}}
    merged = merge_env_vars(runtime_env, {"B": "3", "C": 4, "D": True})
    assert merged == {"pip": ["x"], "env_vars": {"A": "1", "B": "3", "C": "4", "D": "true"}}
    assert runtime_env["env_vars"] == {"A": "1", "B": "2"}  # input not mutated
    with pytest.raises(ValueError, match=r"env_vars\['E'\] is a dict"):
        merge_env_vars(None, {"E": {"nested": 1}})
