"""Retries with exponential backoff and jitter for transient store errors.

Three layers retry S3 transfers, and that is deliberate: botocore retries each request (a part of a
multipart upload) in "standard" mode, s3fs retries some connection errors, and ``call_with_retries``
retries a whole file when an error still gets through (s3fs aborts the multipart upload first). WebHDFS
and local stores only have this last layer.

Retryable: connection resets and timeouts, HTTP 408/429/5xx, S3 throttling codes (``SlowDown``...), and
the ``OSError`` errnos s3fs maps those to (``EBUSY`` for 503, ``EREMOTEIO`` for 500). Not retryable:
missing files, permissions, client errors (4xx), anything else.
"""

from __future__ import annotations

import errno
import functools
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from rlhf_ops.storage.stores import scrub_secrets

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_HTTP_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
_RETRYABLE_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.EBUSY}
    | {errno.EREMOTEIO, errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETRESET}
)
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception types of the HTTP stacks under s3fs and WebHDFS, where installed."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError

        found += [BotoConnectionError, HTTPClientError]
    except ImportError:
        pass
    try:
        import aiohttp

        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    try:
        import requests

        found += [requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError]
    except ImportError:
        pass
    return tuple(found)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _http_status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status, response.get("Error", {}).get("Code")
    status = getattr(response, "status_code", None)  # requests.HTTPError
    return (status if isinstance(status, int) else None), None


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a transient store error."""
    if isinstance(exc, _PERMANENT):
        return False
    for link in _chain(exc):
        if isinstance(link, _transport_errors()):
            return True
        status, code = _http_status_and_code(link)
        if status in RETRYABLE_HTTP_STATUS or code in _THROTTLING_CODES:
            return True
        if isinstance(link, OSError) and link.errno in _RETRYABLE_ERRNOS:
            return True
    return False


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how long to retry."""

    retries: int = 5
    """Retries after the first attempt (``0`` disables retrying)."""
    backoff_s: float = 0.5
    """Base delay: retry ``i`` (from 0) waits between half and all of ``backoff_s * 2**i``."""
    max_backoff_s: float = 30.0
    """Cap on one delay."""

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {self.backoff_s}, {self.max_backoff_s}")

    def delay(self, retry_index: int, *, rng: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry ``retry_index`` (0-based): "equal jitter", never below half the base."""
        base = min(self.max_backoff_s, self.backoff_s * 2**retry_index)
        return base / 2 + rng() * base / 2


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    what: str,
    on_retry: Callable[[BaseException], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """Call ``fn`` until it succeeds, retrying transient errors (``is_retryable``) per ``policy``.

    Args:
        fn: the operation, without arguments.
        policy: retries and backoff.
        what: what is being done, for log lines (a path or URL; never credentials).
        on_retry: called with the error before each retry (e.g. to count retries).
        sleep: the sleep function.

    Returns:
        ``fn()``'s result. The last error is re-raised unchanged when retries run out or it is not transient.
    """
    for attempt in range(policy.retries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == policy.retries or not is_retryable(exc):
                raise
            wait = policy.delay(attempt)
            name, message = type(exc).__name__, scrub_secrets(str(exc))
            logger.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs", what, name, message, attempt + 1, policy.retries, wait
            )
            if on_retry is not None:
                on_retry(exc)
            sleep(wait)
    raise AssertionError("unreachable: the loop returns or raises")
