"""Probe threshold logic and the three probe handlers against local servers."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from batchtune_local.nodeagent.probes import ProbeKind, ProbeSpec, ProbeTracker, resolve_port, run_probe


def test_readiness_needs_success_threshold_and_failure_threshold():
    spec = ProbeSpec({}, initial_delay_s=5, period_s=1, success_threshold=2, failure_threshold=3)
    t = ProbeTracker(ProbeKind.READINESS, spec, started_at=100.0)
    assert not t.result
    assert not t.due(104.9) and t.due(105.0)
    assert t.record(True, 105) is False  # one success of two
    assert not t.due(105.5) and t.due(106.0)
    assert t.record(True, 106) is True
    assert t.record(False, 107) is True and t.record(False, 108) is True  # below failure threshold
    assert t.record(False, 109) is False
    assert t.record(True, 110) is False  # needs two again


def test_liveness_starts_successful_and_fails_out():
    t = ProbeTracker(ProbeKind.LIVENESS, ProbeSpec({}, failure_threshold=2), started_at=0)
    assert t.result
    t.record(False, 1)
    assert not t.failed_out
    t.record(False, 2)
    assert t.failed_out and not t.result


def test_from_spec_scales_delays_not_timeouts():
    spec = ProbeSpec.from_spec({"initialDelaySeconds": 60, "periodSeconds": 10, "timeoutSeconds": 2}, time_scale=10)
    assert (spec.initial_delay_s, spec.period_s, spec.timeout_s) == (6.0, 1.0, 2.0)
    assert ProbeSpec.from_spec({}).period_s == 10 and ProbeSpec.from_spec({}).failure_threshold == 3


@pytest.fixture
def http_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


CONTAINER = {"name": "c", "ports": [{"name": "http", "containerPort": 0}]}


def probe(handler, port, container=CONTAINER):
    container = {**container, "ports": [{"name": "http", "containerPort": port}]}
    return run_probe(ProbeSpec(handler, timeout_s=1), pod_ip="127.0.0.1", container=container, env={}, cwd="/")


def test_http_get_success_and_failure(http_server):
    assert probe({"httpGet": {"path": "/health", "port": http_server}}, http_server) == (True, "")
    assert probe({"httpGet": {"path": "/health", "port": "http"}}, http_server) == (True, "")
    ok, message = probe({"httpGet": {"path": "/nope", "port": http_server}}, http_server)
    assert not ok and "statuscode: 503" in message


def test_tcp_socket(http_server):
    assert probe({"tcpSocket": {"port": http_server}}, http_server)[0]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert not probe({"tcpSocket": {"port": port}}, port)[0]


def test_exec(tmp_path):
    ok = run_probe(ProbeSpec({"exec": {"command": ["sh", "-c", "test \"$X\" = yes"]}}), pod_ip="127.0.0.1",
                   container=CONTAINER, env={"X": "yes", "PATH": "/usr/bin:/bin"}, cwd=str(tmp_path))
    assert ok == (True, "")
    bad = run_probe(ProbeSpec({"exec": {"command": ["sh", "-c", "echo nope; exit 3"]}}), pod_ip="127.0.0.1",
                    container=CONTAINER, env={"PATH": "/usr/bin:/bin"}, cwd=str(tmp_path))
    assert bad == (False, "nope\n")


def test_named_port_missing_names_it():
    with pytest.raises(ValueError, match="no port named 'metrics'"):
        resolve_port("metrics", CONTAINER)
