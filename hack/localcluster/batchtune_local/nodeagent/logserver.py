"""The slice of the kubelet API that `kubectl logs` needs: GET /containerLogs/NS/POD/CONTAINER over TLS.

The API server dials the node's InternalIP at `status.daemonEndpoints.kubeletEndpoint.Port`;
without `--kubelet-certificate-authority` it does not verify this self-signed certificate.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger("batchtune_local.nodeagent")


@dataclass(frozen=True)
class LogSource:
    path: Path
    start: int
    """Byte offset where the requested run begins."""
    end: int | None
    """Byte offset where it ends (None: the current run, still growing)."""
    running: Callable[[], bool]
    """Whether more output may come (for follow)."""


# (namespace, pod, container, previous) -> where its log is, or None when unknown.
LogLookup = Callable[[str, str, str, bool], "LogSource | None"]


def ensure_certificate(directory: Path) -> tuple[Path, Path] | None:
    """A self-signed serving certificate for 127.0.0.1 (made once with openssl), or None without openssl."""
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    if cert.exists() and key.exists():
        return cert, key
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                    "-subj", "/CN=batchtune-node-agent", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    os.chmod(key, 0o600)
    return cert, key


def select(data: bytes, tail_lines: int | None, limit_bytes: int | None) -> bytes:
    """Apply `tailLines` then `limitBytes` as the kubelet does."""
    if tail_lines is not None:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-tail_lines:]) if tail_lines > 0 else b""
    if limit_bytes is not None:
        data = data[:limit_bytes]
    return data


class LogServer:
    def __init__(self, address: str, cert: tuple[Path, Path], lookup: LogLookup) -> None:
        host, _, port = address.rpartition(":")
        find = lookup

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                url = urllib.parse.urlsplit(self.path)
                parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
                if parts == ["healthz"]:
                    self._send(200, b"ok")
                    return
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self._send(404, b"only /containerLogs/NAMESPACE/POD/CONTAINER is served by the batchtune node agent")
                    return
                query = urllib.parse.parse_qs(url.query)

                def flag(name: str) -> bool:
                    return query.get(name, ["false"])[0].lower() in ("true", "1")

                def number(name: str) -> int | None:
                    value = query.get(name, [None])[0]
                    return int(value) if value not in (None, "") else None

                source = find(parts[1], parts[2], parts[3], flag("previous"))
                if source is None or not source.path.exists():
                    self._send(404, f"container {parts[3]!r} of pod {parts[1]}/{parts[2]} has no log here".encode())
                    return
                with open(source.path, "rb") as fh:
                    fh.seek(source.start)
                    data = fh.read() if source.end is None else fh.read(max(0, source.end - source.start))
                    position = fh.tell()
                    body = select(data, number("tailLines"), number("limitBytes"))
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.end_headers()
                    self.wfile.write(body)
                    self.wfile.flush()
                    if not flag("follow") or source.end is not None:
                        return
                    while source.running():
                        fh.seek(position)
                        chunk = fh.read()
                        position = fh.tell()
                        if chunk:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        else:
                            time.sleep(0.2)

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
        self.server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert[0]), str(cert[1]))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, name="kubelet-logs", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
