"""A threaded HTTP reverse proxy on 127.0.0.1 that injects faults into chosen requests.

Put it between a client and a real server (moto) by pointing the client's endpoint at ``proxy.url``.
Requests that ``match`` (by default S3 ``UploadPart``: a PUT with ``partNumber`` and ``uploadId``) get,
in order, the faults listed in ``faults`` (one per request), then pass through; with ``always`` every
matching request gets that fault. Faults:

- ``"reset"``: read the request, then close the TCP connection with RST (``SO_LINGER`` 0);
- ``"500"``: HTTP 500 with S3's ``InternalError`` XML body;
- ``"503"``: HTTP 503 with S3's ``SlowDown`` XML body.

``delay_s`` sleeps before forwarding each matching request (to make an upload slow enough to kill).
Everything else is forwarded unchanged (SigV4 signs the Host header; moto does not check signatures).
Counters: ``matched``, ``injected``, ``forwarded``.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect", "server", "date"}
_S3_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}


def is_upload_part(method: str, path: str) -> bool:
    """S3 UploadPart: ``PUT /bucket/key?partNumber=N&uploadId=...``."""
    query = parse_qs(urlsplit(path).query)
    return method == "PUT" and "partNumber" in query and "uploadId" in query


class FaultProxy:
    """Reverse proxy to ``upstream`` (``http://host:port``) with fault injection; a context manager."""

    def __init__(
        self,
        upstream: str,
        *,
        faults: Sequence[str] = (),
        always: str | None = None,
        delay_s: float = 0.0,
        match: Callable[[str, str], bool] = is_upload_part,
    ) -> None:
        for fault in [*faults, *([always] if always else [])]:
            if fault not in ("reset", *_S3_ERRORS):
                raise ValueError(f"unknown fault {fault!r}; use 'reset', '500' or '503'")
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
        self.faults = list(faults)
        self.always = always
        self.delay_s = delay_s
        self.match = match
        self.matched = self.injected = self.forwarded = 0
        self._lock = threading.Lock()
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _next_fault(self, method: str, path: str) -> tuple[str | None, bool]:
        """``(fault to inject or None, whether the request matched)``."""
        if not self.match(method, path):
            return None, False
        with self._lock:
            index = self.matched
            self.matched += 1
            fault = self.always or (self.faults[index] if index < len(self.faults) else None)
            if fault is not None:
                self.injected += 1
            return fault, True


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy


class _Handler(BaseHTTPRequestHandler):
    server: _ProxyServer

    protocol_version = "HTTP/1.1"  # answers "Expect: 100-continue"; each response closes the connection

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def _error(self, fault: str) -> None:
        status, code, message = _S3_ERRORS[fault]
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self._reply(status, [("Content-Type", "application/xml")], body)

    def _reply(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers:
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        # A HEAD response has no body but announces the object's length: keep upstream's.
        upstream_length = next((v for k, v in headers if k.lower() == "content-length"), None)
        length = upstream_length if self.command == "HEAD" and upstream_length is not None else str(len(body))
        self.send_header("Content-Length", length)
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    def _forward(self, body: bytes) -> None:
        proxy = self.server.proxy
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            self._reply(response.status, response.getheaders(), data)
        finally:
            upstream.close()
        with proxy._lock:
            proxy.forwarded += 1

    def _handle(self) -> None:
        body = self._body()
        fault, matched = self.server.proxy._next_fault(self.command, self.path)
        if fault == "reset":
            self._reset()
            return
        if fault is not None:
            self._error(fault)
            return
        if matched and self.server.proxy.delay_s:
            time.sleep(self.server.proxy.delay_s)
        self._forward(body)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:  # the socket was reset on purpose
            pass

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
