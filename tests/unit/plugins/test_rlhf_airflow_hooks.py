"""RayJobHook connection handling; what Ray jobs and this worker get from the connections (AIRFLOW_CONN_* env vars)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException
from airflow.sdk.log import redact

from rlhf_airflow.hooks import (
    RayJobHook,
    job_env_from_connections,
    merge_env_vars,
    normalize_dashboard_address,
    worker_env_from_connections,
)


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


def test_verify_left_empty_in_the_form_means_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow 3.1 without FAB shows the TLS field without its default: saved empty, TLS is still verified."""
    _conn(monkeypatch, "ray_empty", conn_type="ray", host="ray.internal", port=8265, extra={"verify": ""})
    assert RayJobHook("ray_empty").client_config()[2] is True


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


def test_job_env_forwards_settings_and_no_secret_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(
        monkeypatch,
        "s3_test",
        conn_type="aws",
        login="AKIATESTKEY",
        password="FAKE-SECRET-abc123",
        extra={"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
    )
    _conn(monkeypatch, "mlflow_test", conn_type="http", host="mlflow", port=5000, login="bot", password="mlf-pass-77")
    env = job_env_from_connections(s3_conn_id="s3_test", mlflow_conn_id="mlflow_test")
    assert env == {  # the cluster's own identity does the rest: no key, no password
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
        "FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_REGION": "eu-west-1",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
    }
    _conn(monkeypatch, "mlflow_userinfo", conn_type="http", host="http://bot:mlf-pass-77@mlflow:5000")
    assert job_env_from_connections(mlflow_conn_id="mlflow_userinfo") == {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}
    assert job_env_from_connections() == {}


def test_worker_env_resolves_credentials_through_the_amazon_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    _conn(
        monkeypatch,
        "s3_test",
        conn_type="aws",
        login="AKIATESTKEY",
        password="s3-secret-value-42",
        extra={"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
    )
    _conn(monkeypatch, "mlflow_test", conn_type="http", host="mlflow", port=5000, login="bot", password="mlf-pass-77")
    env = worker_env_from_connections(s3_conn_id="s3_test", mlflow_conn_id="mlflow_test")
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == ("AKIATESTKEY", "s3-secret-value-42")
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("bot", "mlf-pass-77")
    assert env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9000" and "AWS_SESSION_TOKEN" not in env
    assert redact(f"{env['AWS_SECRET_ACCESS_KEY']} {env['MLFLOW_TRACKING_PASSWORD']}") == "*** ***"


@pytest.fixture
def mocked_aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """AWS's STS answered in process (moto); no real account, no profile files."""
    from moto import mock_aws

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    with mock_aws():
        yield


@pytest.mark.usefixtures("mocked_aws")
def test_opt_in_forwarding_exchanges_long_lived_keys_for_an_sts_session(monkeypatch: pytest.MonkeyPatch) -> None:
    long_lived = {"login": "AKIAJ7Q2X4K9LMN3PQRS", "password": "FAKE-SECRET-abc123"}
    _conn(
        monkeypatch,
        "s3_fwd",
        conn_type="aws",
        extra={"region_name": "us-east-1", "forward_credentials": True},
        **long_lived,
    )
    env = job_env_from_connections(s3_conn_id="s3_fwd")
    assert env["AWS_SESSION_TOKEN"] and env["AWS_CREDENTIAL_EXPIRATION"]  # an STS session, with its expiry
    assert env["AWS_ACCESS_KEY_ID"] != long_lived["login"]
    assert long_lived["password"] not in json.dumps(env)
    _conn(monkeypatch, "s3_plain", conn_type="aws", extra={"region_name": "us-east-1"}, **long_lived)
    assert "AWS_SESSION_TOKEN" not in job_env_from_connections(s3_conn_id="s3_plain")  # opt-in only
    assert job_env_from_connections(s3_conn_id="s3_plain", forward_credentials=True)["AWS_SESSION_TOKEN"]


@pytest.mark.usefixtures("mocked_aws")
def test_assume_role_connection_forwards_the_roles_session(monkeypatch: pytest.MonkeyPatch) -> None:
    role = "arn:aws:iam::123456789012:role/rlhf-jobs"
    _conn(
        monkeypatch,
        "s3_role",
        conn_type="aws",
        login="AKIAJ7Q2X4K9LMN3PQRS",
        password="FAKE-SECRET-abc123",
        extra={"role_arn": role, "region_name": "us-east-1"},
    )
    worker = worker_env_from_connections(s3_conn_id="s3_role")
    assert worker["AWS_SESSION_TOKEN"] and worker["AWS_ACCESS_KEY_ID"] != "AKIAJ7Q2X4K9LMN3PQRS"  # the role's
    forwarded = job_env_from_connections(s3_conn_id="s3_role", forward_credentials=True)
    assert forwarded["AWS_ACCESS_KEY_ID"] != "AKIAJ7Q2X4K9LMN3PQRS" and forwarded["AWS_CREDENTIAL_EXPIRATION"]
    assert "FAKE-SECRET-abc123" not in json.dumps(forwarded)


def test_merge_env_vars_overrides_and_validates() -> None:
    runtime_env = {"pip": ["x"], "env_vars": {"A": "1", "B": "2"}}
    merged = merge_env_vars(runtime_env, {"B": "3", "C": 4, "D": True})
    assert merged == {"pip": ["x"], "env_vars": {"A": "1", "B": "3", "C": "4", "D": "true"}}
    assert runtime_env["env_vars"] == {"A": "1", "B": "2"}  # input not mutated
    with pytest.raises(ValueError, match=r"env_vars\['E'\] is a dict"):
        merge_env_vars(None, {"E": {"nested": 1}})
