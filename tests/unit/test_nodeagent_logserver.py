"""The `kubectl logs` endpoint: selection of lines/bytes and the TLS server."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from batchtune_local.nodeagent.logserver import LogServer, LogSource, ensure_certificate, select


@pytest.mark.parametrize(
    "tail, limit, expected",
    [
        pytest.param(None, None, b"a\nb\nc\n", id="all"),
        pytest.param(2, None, b"b\nc\n", id="tail"),
        pytest.param(0, None, b"", id="tail-zero"),
        pytest.param(None, 3, b"a\nb", id="limit"),
        pytest.param(2, 3, b"b\nc", id="tail-then-limit"),
    ],
)
def test_select(tail, limit, expected):
    assert select(b"a\nb\nc\n", tail, limit) == expected


def test_server_serves_current_and_previous_run(tmp_path):
    cert = ensure_certificate(tmp_path / "tls")
    if cert is None:
        pytest.skip("no openssl")
    log = tmp_path / "main.log"
    log.write_bytes(b"run one\nrun two\n")
    offset = len(b"run one\n")

    def lookup(namespace, pod, container, previous):
        if (namespace, pod, container) != ("ns", "p", "main"):
            return None
        return LogSource(log, 0, offset, lambda: False) if previous else LogSource(log, offset, None, lambda: False)

    server = LogServer("127.0.0.1:0", cert, lookup)
    server.start()
    context = ssl._create_unverified_context()  # as the API server without --kubelet-certificate-authority
    base = f"https://127.0.0.1:{server.port}/containerLogs/ns/p/main"
    try:
        assert urllib.request.urlopen(base, context=context, timeout=5).read() == b"run two\n"
        assert urllib.request.urlopen(base + "?previous=true", context=context, timeout=5).read() == b"run one\n"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base.replace("/main", "/other"), context=context, timeout=5)
        assert err.value.code == 404
    finally:
        server.stop()
