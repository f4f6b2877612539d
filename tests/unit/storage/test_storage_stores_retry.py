"""Store URLs and options (no network: constructing a filesystem does not connect) and the retry policy."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import requests
from botocore.exceptions import ClientError, EndpointConnectionError
from fsspec.implementations.local import LocalFileSystem

from rlhf_ops.storage.retry import RetryPolicy, call_with_retries, is_retryable
from rlhf_ops.storage.stores import open_store, redact_url, scrub_secrets, url_scheme


def test_plain_and_file_paths_open_the_local_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fs, root = open_store("runs/exp")
    assert isinstance(fs, LocalFileSystem) and root == f"{tmp_path}/runs/exp"
    fs, root = open_store(f"file://{tmp_path}/runs/")
    assert isinstance(fs, LocalFileSystem) and root == f"{tmp_path}/runs"
    assert url_scheme("runs/exp") == "file" and url_scheme("S3://b/k") == "s3"


def test_s3_takes_endpoint_and_region_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    fs, root = open_store("s3://bucket/exp/run/")
    assert root == "bucket/exp/run"
    assert fs.endpoint_url == "http://127.0.0.1:1"
    assert fs.client_kwargs == {"region_name": "eu-west-3"}
    assert fs.config_kwargs["retries"] == {"mode": "standard", "total_max_attempts": 4}


def test_s3_storage_options_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    options = {"endpoint_url": "http://127.0.0.1:2", "key": "k", "secret": "s", "config_kwargs": {"retries": {}}}
    fs, _ = open_store("s3://bucket/run", storage_options=options)
    assert fs.endpoint_url == "http://127.0.0.1:2" and fs.key == "k"
    assert fs.config_kwargs["retries"] == {}
    assert options["config_kwargs"] == {"retries": {}}  # the caller's dict is not modified


def test_webhdfs_url_gives_namenode_and_path() -> None:
    fs, root = open_store("webhdfs://namenode:9870/user/rlhf/runs")
    assert fs.url == "http://namenode:9870/webhdfs/v1" and root == "/user/rlhf/runs"


@pytest.mark.skipif(bool(os.environ.get("JAVA_HOME")), reason="a JVM is installed: it would try to connect")
def test_hdfs_without_a_jvm_explains_what_it_needs() -> None:
    with pytest.raises(OSError, match=r"hdfs:// needs a JVM and libhdfs .* or use webhdfs://"):
        open_store("hdfs://127.0.0.1:1/runs")


def test_unknown_protocol_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"fsspec knows no protocol 'nosuch'; use one of file://") as info:
        open_store("nosuch://bucket/run")
    assert "\n" not in str(info.value)


def test_known_protocol_without_its_package_names_the_package() -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"gs:// is not installed \(Please install gcsfs"):
            open_store("gs://bucket/run")
    else:
        pytest.skip("gcsfs is installed")


def test_urls_and_messages_are_redacted() -> None:
    assert redact_url("webhdfs://alice:pw@nn:9870/runs?delegation=T0K") == "webhdfs://alice:***@nn:9870/runs"
    assert redact_url("s3://bucket/run") == "s3://bucket/run"
    message = "url: /webhdfs/v1/a?op=OPEN&delegation=SECRET&user.name=x and X-Amz-Signature=abc"
    assert scrub_secrets(message) == "url: /webhdfs/v1/a?op=OPEN&delegation=***&user.name=x and X-Amz-Signature=***"


def _client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "UploadPart")


def _http_error(status: int) -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    return requests.HTTPError(response=response)


def _translated(cause: BaseException) -> OSError:
    error = OSError(errno.EIO, "translated by s3fs")
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (EndpointConnectionError(endpoint_url="http://x"), True),
        (OSError(errno.EBUSY, "SlowDown"), True),  # s3fs maps 503 to EBUSY
        (_client_error(503, "SlowDown"), True),
        (_client_error(200, "InternalError"), True),
        (_client_error(403, "AccessDenied"), False),
        (_http_error(503), True),
        (_http_error(404), False),
        (requests.ConnectionError(), True),
        (_translated(_client_error(500, "InternalError")), True),
        (_translated(ValueError()), False),
        (FileNotFoundError(), False),
        (ValueError(), False),
    ],
)
def test_is_retryable(error: BaseException, expected: bool) -> None:
    assert is_retryable(error) is expected


def test_backoff_doubles_with_equal_jitter_and_is_capped() -> None:
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=30.0)
    # base = min(30, 0.5 * 2**i); delay = base/2 + rng*base/2
    assert policy.delay(0, rng=lambda: 0.0) == 0.25
    assert policy.delay(3, rng=lambda: 0.0) == 2.0  # 0.5 * 8 / 2
    assert policy.delay(3, rng=lambda: 1.0) == 4.0
    assert policy.delay(10, rng=lambda: 1.0) == 30.0  # 0.5 * 1024 = 512, capped


def test_call_with_retries_retries_transient_errors_then_succeeds() -> None:
    calls: list[int] = []
    sleeps: list[float] = []
    seen: list[BaseException] = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return 7

    policy = RetryPolicy(retries=5, backoff_s=0.5)
    assert call_with_retries(flaky, policy=policy, what="x", on_retry=seen.append, sleep=sleeps.append) == 7
    assert len(calls) == 3 and len(seen) == 2
    assert 0.25 <= sleeps[0] <= 0.5 and 0.5 <= sleeps[1] <= 1.0


def test_call_with_retries_gives_up_and_reraises() -> None:
    calls: list[int] = []

    def always(error: BaseException) -> None:
        calls.append(1)
        raise error

    with pytest.raises(ConnectionResetError):
        call_with_retries(lambda: always(ConnectionResetError()), policy=RetryPolicy(retries=2), what="x", sleep=id)
    assert len(calls) == 3  # first attempt + 2 retries
    with pytest.raises(PermissionError):
        call_with_retries(lambda: always(PermissionError()), policy=RetryPolicy(retries=2), what="x", sleep=id)
    assert len(calls) == 4  # not transient: no retry


def test_retry_policy_rejects_negative_values() -> None:
    with pytest.raises(ValueError, match="retries must be >= 0"):
        RetryPolicy(retries=-1)
    with pytest.raises(ValueError, match="backoff_s"):
        RetryPolicy(backoff_s=-0.1)
