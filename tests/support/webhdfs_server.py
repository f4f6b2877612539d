"""A protocol-level WebHDFS server for tests: a "NameNode" and a "DataNode" over one temp directory.

What it does: it speaks the WebHDFS REST API (``/webhdfs/v1/<path>?op=...``, JSON bodies and
``RemoteException`` errors as Hadoop sends them) on two HTTP servers bound to 127.0.0.1 on free ports.
The NameNode answers the metadata operations (GETFILESTATUS, LISTSTATUS, GETCONTENTSUMMARY,
GETHOMEDIRECTORY, MKDIRS, RENAME, DELETE) and redirects data operations (CREATE, APPEND, OPEN) with a
307 to the DataNode, which reads and writes the bytes. That is the two-step protocol fsspec's
``WebHDFS`` client follows (CREATE with ``redirect=False``, an empty PUT to the DataNode, then APPEND
POSTs of each block; OPEN with ``offset``/``length`` redirected to the DataNode).

What it does not exercise: Kerberos/SPNEGO, delegation tokens or any authentication (``user.name`` is
accepted and ignored); permissions, owners and quotas; a real NameNode or DataNode (no blocks, no
replication, no pipeline recovery, no safe mode, no HA failover or standby NameNode); leases (two
writers of one file are not refused); GETFILECHECKSUM (answered as unsupported); HttpFS gateways;
HTTPS. Writes go straight to local files, so a reader can see a partly written file, as with HDFS.

``fail_write_paths`` makes DataNode writes (CREATE/APPEND) of HDFS paths containing any of the given
substrings fail with HTTP 500 and a ``RemoteException``, to interrupt uploads. ``op_counts`` counts
requests per ``(role, op)``, e.g. ``("datanode", "CREATE")``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

PREFIX = "/webhdfs/v1"
_EXCEPTIONS = {
    "FileNotFoundException": (404, "java.io.FileNotFoundException"),
    "FileAlreadyExistsException": (403, "org.apache.hadoop.fs.FileAlreadyExistsException"),
    "PathIsNotEmptyDirectoryException": (403, "org.apache.hadoop.fs.PathIsNotEmptyDirectoryException"),
    "IllegalArgumentException": (400, "java.lang.IllegalArgumentException"),
    "UnsupportedOperationException": (400, "java.lang.UnsupportedOperationException"),
    "IOException": (500, "java.io.IOException"),
}


class _HdfsError(Exception):
    def __init__(self, exception: str, message: str) -> None:
        super().__init__(message)
        self.exception = exception


class WebHDFSServer:
    """NameNode + DataNode over ``root`` (a fresh temp dir when ``None``); a context manager."""

    def __init__(self, root: Path | None = None) -> None:
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="webhdfs-"))
        self.fail_write_paths: set[str] = set()
        self.op_counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._namenode = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("namenode"))
        self._datanode = ThreadingHTTPServer(("127.0.0.1", 0), self._handler("datanode"))
        self._threads = [
            threading.Thread(target=server.serve_forever, args=(0.05,), name=f"webhdfs-{i}", daemon=True)
            for i, server in enumerate((self._namenode, self._datanode))
        ]

    @property
    def port(self) -> int:
        """The NameNode port (the one in ``webhdfs://`` URLs)."""
        return int(self._namenode.server_address[1])

    def url(self, path: str = "/") -> str:
        """``webhdfs://127.0.0.1:<port><path>``."""
        return f"webhdfs://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def local(self, path: str) -> Path:
        """The backing file of an HDFS path."""
        return self._resolve(path)

    def start(self) -> WebHDFSServer:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        for server in (self._namenode, self._datanode):
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> WebHDFSServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- filesystem model -------------------------------------------------------------------------
    def _resolve(self, hdfs_path: str) -> Path:
        parts = [p for p in hdfs_path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise _HdfsError("IllegalArgumentException", f"Invalid path name {hdfs_path}")
        return self.root.joinpath(*parts)

    @staticmethod
    def _status(path: Path, suffix: str) -> dict[str, Any]:
        stat = path.stat()
        is_dir = path.is_dir()
        return {
            "accessTime": int(stat.st_atime * 1000),
            "blockSize": 134217728,
            "childrenNum": len(list(path.iterdir())) if is_dir else 0,
            "fileId": stat.st_ino,
            "group": "supergroup",
            "length": 0 if is_dir else stat.st_size,
            "modificationTime": int(stat.st_mtime * 1000),
            "owner": "hdfs",
            "pathSuffix": suffix,
            "permission": "755" if is_dir else "644",
            "replication": 0 if is_dir else 3,
            "storagePolicy": 0,
            "type": "DIRECTORY" if is_dir else "FILE",
        }

    def _existing(self, hdfs_path: str) -> Path:
        path = self._resolve(hdfs_path)
        if not path.exists():
            raise _HdfsError("FileNotFoundException", f"File does not exist: {hdfs_path}")
        return path

    def _namenode_op(self, method: str, op: str, hdfs_path: str, query: dict[str, str]) -> tuple[int, Any]:
        """``(status, JSON body)``, or ``(307, location)`` for data operations."""
        if op == "GETFILESTATUS":
            return 200, {"FileStatus": self._status(self._existing(hdfs_path), "")}
        if op == "LISTSTATUS":
            path = self._existing(hdfs_path)
            children = sorted(path.iterdir()) if path.is_dir() else []
            statuses = [self._status(c, c.name) for c in children] if path.is_dir() else [self._status(path, "")]
            return 200, {"FileStatuses": {"FileStatus": statuses}}
        if op == "GETCONTENTSUMMARY":
            path = self._existing(hdfs_path)
            files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
            dirs = [p for p in path.rglob("*") if p.is_dir()] if path.is_dir() else []
            length = sum(p.stat().st_size for p in files)
            return 200, {
                "ContentSummary": {
                    "directoryCount": len(dirs) + path.is_dir(),
                    "fileCount": len(files),
                    "length": length,
                    "quota": -1,
                    "spaceConsumed": 3 * length,
                    "spaceQuota": -1,
                }
            }
        if op == "GETHOMEDIRECTORY":
            return 200, {"Path": f"/user/{query.get('user.name', 'dr.who')}"}
        if op == "MKDIRS" and method == "PUT":
            path = self._resolve(hdfs_path)
            if path.is_file():
                raise _HdfsError("FileAlreadyExistsException", f"Path is not a directory: {hdfs_path}")
            path.mkdir(parents=True, exist_ok=True)
            return 200, {"boolean": True}
        if op == "DELETE" and method == "DELETE":
            return 200, {"boolean": self._delete(hdfs_path, query.get("recursive", "false") == "true")}
        if op == "RENAME" and method == "PUT":
            return 200, {"boolean": self._rename(hdfs_path, query.get("destination", ""))}
        if op in ("CREATE", "APPEND", "OPEN"):
            return self._redirect(method, op, hdfs_path, query)
        if op == "GETFILECHECKSUM":
            raise _HdfsError("UnsupportedOperationException", "GETFILECHECKSUM is not implemented by the test server")
        raise _HdfsError("IllegalArgumentException", f'Invalid value for webhdfs parameter "op": {op} ({method})')

    def _redirect(self, method: str, op: str, hdfs_path: str, query: dict[str, str]) -> tuple[int, Any]:
        expected = {"CREATE": "PUT", "APPEND": "POST", "OPEN": "GET"}[op]
        if method != expected:
            raise _HdfsError("IllegalArgumentException", f"{op} needs {expected}, got {method}")
        path = self._resolve(hdfs_path)
        if op == "CREATE":
            if path.is_dir():
                raise _HdfsError("FileAlreadyExistsException", f"{hdfs_path} already exists as a directory")
            if path.exists() and query.get("overwrite", "false") != "true":
                raise _HdfsError("FileAlreadyExistsException", f"{hdfs_path} for client 127.0.0.1 already exists")
        elif not path.is_file():
            raise _HdfsError("FileNotFoundException", f"File does not exist: {hdfs_path}")
        params = {**query, "op": op, "namenoderpcaddress": f"127.0.0.1:{self.port}"}
        query_string = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items())
        location = f"http://127.0.0.1:{self._datanode.server_address[1]}{PREFIX}{quote(hdfs_path)}?{query_string}"
        return 307, location

    def _delete(self, hdfs_path: str, recursive: bool) -> bool:
        path = self._resolve(hdfs_path)
        if not path.exists() or path == self.root:
            return False
        if path.is_dir():
            if any(path.iterdir()) and not recursive:
                raise _HdfsError(
                    "PathIsNotEmptyDirectoryException", f"`{hdfs_path} is non empty': Directory is not empty"
                )
            shutil.rmtree(path)
        else:
            path.unlink()
        return True

    def _rename(self, source: str, destination: str) -> bool:
        src, dst = self._resolve(source), self._resolve(destination)
        if not src.exists() or not destination.startswith("/") or not dst.parent.is_dir():
            return False
        if dst.is_dir():  # HDFS moves into an existing directory
            dst = dst / src.name
        if dst.exists():
            return False
        src.rename(dst)
        return True

    def _datanode_op(self, method: str, op: str, hdfs_path: str, query: dict[str, str], body: bytes) -> bytes:
        path = self._resolve(hdfs_path)
        if op in ("CREATE", "APPEND") and any(s in hdfs_path for s in self.fail_write_paths):
            raise _HdfsError("IOException", f"injected DataNode write failure for {hdfs_path}")
        if op == "CREATE" and method == "PUT":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
            return b""
        if op == "APPEND" and method == "POST":
            with open(self._existing(hdfs_path), "ab") as handle:
                handle.write(body)
            return b""
        if op == "OPEN" and method == "GET":
            offset = int(query.get("offset", 0))
            length = query.get("length")
            with open(self._existing(hdfs_path), "rb") as handle:
                handle.seek(offset)
                return handle.read(int(length)) if length is not None else handle.read()
        raise _HdfsError("IllegalArgumentException", f"DataNode cannot {method} op={op}")

    # --- HTTP -----------------------------------------------------------------------------------------
    def _handler(self, role: str) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                parts = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                op = query.get("op", "").upper()
                with server._lock:
                    server.op_counts[(role, op)] += 1
                if not parts.path.startswith(PREFIX):
                    self._send(404, b"not a WebHDFS path", "text/plain")
                    return
                hdfs_path = unquote(parts.path[len(PREFIX) :]) or "/"
                try:
                    if role == "namenode":
                        status, result = server._namenode_op(self.command, op, hdfs_path, query)
                        if status == 307:
                            self._send(307, b"", "application/octet-stream", {"Location": str(result)})
                        else:
                            self._send(status, json.dumps(result).encode(), "application/json")
                    else:
                        data = server._datanode_op(self.command, op, hdfs_path, query, body)
                        status = 201 if op == "CREATE" else 200
                        self._send(status, data, "application/octet-stream")
                except _HdfsError as exc:
                    status, java_class = _EXCEPTIONS[exc.exception]
                    error = {"exception": exc.exception, "javaClassName": java_class, "message": str(exc)}
                    self._send(status, json.dumps({"RemoteException": error}).encode(), "application/json")

            do_GET = do_PUT = do_POST = do_DELETE = _handle

        return Handler
