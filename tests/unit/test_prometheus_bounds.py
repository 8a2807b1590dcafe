"""One tenant's Prometheus cannot stall, flood or redirect the operator (issue 22, sections 1 and 2).

Real HTTP servers on loopback play hostile Prometheus servers: a 150 MiB answer, one that drips a byte
at a time (in its headers or its body), redirects. Names are resolved by a fake resolver, never DNS.
Every case ends within its deadline as `PrometheusUnavailable` ("unknown"), never as a number.
"""

from __future__ import annotations

import contextlib
import threading
import time
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchtune.core.promql import LabelNames, MetricNames, QueryContext
from batchtune.engines import VLLM
from batchtune.prometheus import Production, PrometheusReader, PrometheusRefused, PrometheusUnavailable

ANSWER = b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1,"7"]}]}}'
STOP = threading.Event()


class Hostile(BaseHTTPRequestHandler):
    mode = "ok"
    hits: list[tuple[str, str]] = []  # (path, Host header)
    location = "http://169.254.169.254/latest/meta-data/"

    def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
        Hostile.hits.append((self.path, self.headers.get("Host", "")))
        with contextlib.suppress(OSError):  # the client hung up: what a bounded client does
            getattr(self, f"answer_{Hostile.mode}")()

    def answer_ok(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def answer_huge(self) -> None:  # 150 MiB of a series that never ends
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"values":[')
        chunk = b'[1,"1"],' * (1024 * 1024 // 8)
        for _ in range(150):
            if STOP.is_set():
                return
            self.wfile.write(chunk)

    def answer_drip(self) -> None:  # each read succeeds well within any per-read timeout
        self.send_response(200)
        self.end_headers()
        for byte in ANSWER * 100:
            if STOP.is_set():
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.05)

    def answer_drip_headers(self) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 2000:
            if STOP.is_set():
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.05)

    def answer_redirect(self) -> None:
        self.send_response(302)
        self.send_header("Location", Hostile.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def serve() -> tuple[ThreadingHTTPServer, int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.fixture
def port() -> Iterator[int]:
    Hostile.mode, Hostile.hits = "ok", []
    STOP.clear()
    server, number = serve()
    yield number
    STOP.set()
    server.shutdown()
    server.server_close()


CTX = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(model=None), 95)


def reader(url: str, **kw: object) -> PrometheusReader:
    kw.setdefault("loopback_allowed", True)
    kw.setdefault("timeout_s", 1.0)
    return PrometheusReader(url, CTX, **kw)  # type: ignore[arg-type]


def test_a_good_answer_is_read(port):
    assert reader(f"http://127.0.0.1:{port}").scalar("up") == 7.0


def test_a_huge_answer_stops_at_the_byte_cap_and_memory_stays_bounded(port):
    Hostile.mode = "huge"
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(PrometheusUnavailable, match="an answer over 2097152 bytes; not read further"):
            reader(f"http://127.0.0.1:{port}", timeout_s=20).scalar("up")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * 1024 * 1024, f"the reader held {peak / 2**20:.0f} MiB of a 150 MiB answer"
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("mode", ["drip", "drip_headers"])
def test_a_dripping_server_ends_at_the_query_deadline(port, mode):
    """Each byte arrives well within a per-read timeout; only a deadline on the whole request ends it."""
    Hostile.mode = mode
    started = time.monotonic()
    with pytest.raises(PrometheusUnavailable, match=r"no complete answer within 1s \(the query's deadline\)"):
        reader(f"http://127.0.0.1:{port}", timeout_s=1.0).scalar("up")
    assert time.monotonic() - started < 2.0


def test_a_dripping_server_leaves_production_unknown_never_met(port):
    from datetime import UTC, datetime, timedelta

    Hostile.mode = "drip"
    now = datetime(2026, 12, 2, 6, tzinfo=UTC)
    started = time.monotonic()
    with pytest.raises(PrometheusUnavailable):
        reader(f"http://127.0.0.1:{port}", timeout_s=0.5).production_window(
            Production("ns", ("llm-0",)), now - timedelta(minutes=5), now)
    assert time.monotonic() - started < 1.5  # the first query's deadline ends the window: no 10 queries of 0.5 s


def test_the_tick_budget_bounds_all_queries_of_a_reader(port):
    Hostile.mode = "drip"
    r = reader(f"http://127.0.0.1:{port}", timeout_s=0.4, budget_s=1.0)
    started = time.monotonic()
    failures = []
    for _ in range(10):
        with pytest.raises(PrometheusUnavailable) as caught:
            r.scalar("up")
        failures.append(str(caught.value))
    assert time.monotonic() - started < 1.8
    assert any("this tick's 1s for Prometheus are spent" in f for f in failures)


@pytest.mark.parametrize("location", [
    "http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:{other}/api/v1/query?query=up", "/elsewhere",
])
def test_a_redirect_is_never_followed(port, location):
    other_server, other = serve()
    try:
        Hostile.mode = "redirect"
        Hostile.location = location.format(other=other)
        with pytest.raises(PrometheusUnavailable, match="HTTP 302, a redirect; batchtune never follows one"):
            reader(f"http://127.0.0.1:{port}").scalar("up")
        assert len(Hostile.hits) == 1, Hostile.hits  # the redirect's own request, nothing after it
    finally:
        other_server.shutdown()
        other_server.server_close()


def test_one_tuning_holds_at_most_one_worker_for_prometheus(port):
    """While one query of a BatchTuning waits on a dripping server, its next one fails at once."""
    Hostile.mode = "drip"
    gate = threading.Lock()
    first = threading.Thread(target=lambda: pytest.raises(PrometheusUnavailable, reader(
        f"http://127.0.0.1:{port}", timeout_s=1.5, gate=gate).scalar, "up"))
    first.start()
    time.sleep(0.3)
    started = time.monotonic()
    with pytest.raises(PrometheusUnavailable, match="another query of this BatchTuning is in flight"):
        reader(f"http://127.0.0.1:{port}", gate=gate).scalar("up")
    assert time.monotonic() - started < 0.2
    first.join(5)
    Hostile.mode = "ok"
    assert reader(f"http://127.0.0.1:{port}", gate=gate).scalar("up") == 7.0  # released after the deadline


# ---- names: resolved once, every address checked, the checked one dialled -------------------------

class Resolver:
    def __init__(self, *answers: str) -> None:
        self.answers, self.asked = list(answers), []

    def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        return self.answers


@pytest.mark.parametrize("answers", [
    pytest.param(("169.254.169.254",), id="link-local"),
    pytest.param(("10.0.0.5", "169.254.169.254"), id="one-of-several-is-link-local"),
    pytest.param(("fd00:ec2::254",), id="aws-ipv6-metadata"),
    pytest.param(("::ffff:169.254.169.254",), id="ipv4-mapped"),
    pytest.param(("64:ff9b::a9fe:a9fe",), id="nat64"),
    pytest.param(("100.100.100.200",), id="alibaba-metadata"),
    pytest.param(("127.0.0.1",), id="loopback-not-named-by-the-install"),
    pytest.param(("0.0.0.0",), id="unspecified"),
    pytest.param(("fe80::1",), id="ipv6-link-local"),
    pytest.param(("224.0.0.1",), id="multicast"),
])
def test_a_name_resolving_to_a_refused_address_is_refused(port, answers):
    resolve = Resolver(*answers)
    with pytest.raises(PrometheusRefused, match="prom.example resolves to .* the operator never queries it"):
        reader(f"http://prom.example:{port}", resolver=resolve, loopback_allowed=False).scalar("up")
    assert resolve.asked == [("prom.example", port)]
    assert Hostile.hits == []


def test_the_checked_address_is_dialled_and_the_name_resolved_once(port):
    """The resolver's answer is what the connection goes to; a second query asks no resolver again (a name
    that re-resolves to the metadata address between check and connect never gets dialled)."""
    resolve = Resolver("127.0.0.1")
    r = reader(f"http://prom.example:{port}/prometheus", resolver=resolve)
    assert r.scalar("up") == 7.0
    resolve.answers = ["169.254.169.254"]
    assert r.scalar("up") == 7.0
    assert resolve.asked == [("prom.example", port)]
    assert [(path.split("?")[0], host) for path, host in Hostile.hits] == \
        [("/prometheus/api/v1/query", f"prom.example:{port}")] * 2


@pytest.mark.parametrize("url", [
    "http://2852039166/", "http://[::ffff:169.254.169.254]/", "http://metadata.google.internal/",
    "http://prom:9090/#x", "http://user@prom:9090/",
])
def test_the_reader_itself_refuses_what_the_policy_refuses(url):
    resolve = Resolver("127.0.0.1")
    with pytest.raises(PrometheusRefused):
        reader(url, resolver=resolve).scalar("up")
    assert resolve.asked == []


def test_a_name_that_does_not_resolve_is_unavailable():
    def fail(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    with pytest.raises(PrometheusUnavailable, match="did not resolve"):
        reader("http://prom.example:9090", resolver=fail).scalar("up")


def test_the_readers_of_one_tuning_share_one_gate_and_others_do_not():
    from batchtune.controller.handlers import PrometheusMetrics

    metrics = PrometheusMetrics()
    assert metrics.gate("uid-a") is metrics.gate("uid-a") and metrics.gate("uid-a") is not metrics.gate("uid-b")
