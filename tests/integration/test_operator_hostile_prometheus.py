"""One tenant's Prometheus cannot stall or crash the operator (issue 22, section 2), on the local cluster.

Two BatchTunings point the operator at hostile servers on loopback, which the install allows by name (the
chart's `prometheus.allowedUrls`, rendered with `helm template` and passed on as the chart passes it), so the
operator really dials them: one answers every query with a 150 MiB (valid) JSON body, the other drips its
answer one byte per second, forever. Meanwhile an honest Auto tuning's applied change regresses under a flood of
production traffic (as in `test_operator.py::test_failed_verify_rolls_back_to_the_exact_previous_args`), and its
verify window and rollback must end within their stated bound plus a small margin, while the operator process's
RSS (/proc/<pid>/status, sampled, and its high-water mark) stays under the chart's memory limit.

Without the byte cap the huge answer is read whole (the server sees all of it go out) and the operator's RSS
passes the limit; without the total deadline the dripping query is never let go (the server sees one connection
held for the whole test, never a second dial).
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from operator_env import (
    Traffic,
    batchtuning,
    condition,
    container_of,
    get_bt,
    grant_operator_rbac,
    production,
    running_operator,
    wait_phase,
    wait_status,
)

import batchtune_local as lc
from batchtune.prometheus import QUERY_DEADLINE_SECONDS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "batchtune"
HOSTILE_HOST = "127.0.0.2"
"""Loopback, but not the 127.0.0.1 the test operator allows for the cluster's Prometheus: only the chart value that
names these servers lets the operator dial them."""
SERIES = b'{"metric":{"__name__":"vllm:num_requests_running","pod":"' + b"p" * 200 + b'"},"value":[1,"1"]}'
BLOCK = (SERIES + b",") * (1024 * 1024 // (len(SERIES) + 1))
PREFIX, SUFFIX = b'{"status":"success","data":{"resultType":"vector","result":[', b"]}}"
HUGE_BLOCKS = 150 * 1024 * 1024 // len(BLOCK)
HUGE_BYTES = len(PREFIX) + HUGE_BLOCKS * len(BLOCK) + len(SERIES) + len(SUFFIX)
"""150 MiB of valid Prometheus JSON: ~600k series, which parse to far more than the bytes (issue 22 measured 526 MiB
of RSS growth for a 150 MiB answer)."""
VERIFY_SECONDS = 10  # the CRD's least spec.apply.verifySeconds
SCRAPE_LAG_SECONDS = 5  # operator_env.Operator's BATCHTUNE_SCRAPE_LAG_SECONDS
MARGIN_SECONDS = 10
"""On top of the stated bound: ticks of 1 s, and a busy 2-core machine's API writes and scheduling."""
HOLD_MARGIN_SECONDS = 3
"""On top of the query deadline, until the dripping server notices the operator let go (it looks every second)."""


@dataclass
class Connection:
    opened: float
    closed: float | None = None
    sent: int = 0


class HostileServer(threading.Thread):
    """A loopback HTTP server that answers every request with `respond`; it records each connection's life."""

    def __init__(self, respond: Callable[[socket.socket, Connection, threading.Event], None]) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server((HOSTILE_HOST, 0))
        self.sock.settimeout(0.2)
        self.url = f"http://{HOSTILE_HOST}:{self.sock.getsockname()[1]}"
        self.respond = respond
        self.connections: list[Connection] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            record = Connection(time.monotonic())
            self.connections.append(record)
            threading.Thread(target=self._serve, args=(conn, record), daemon=True).start()

    def _serve(self, conn: socket.socket, record: Connection) -> None:
        try:
            with conn:
                conn.settimeout(30)
                request = b""
                while b"\r\n\r\n" not in request and len(request) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    request += chunk
                self.respond(conn, record, self.stopping)
        except OSError:
            pass  # the operator hung up: what a bounded client does
        finally:
            record.closed = time.monotonic()

    def held(self) -> list[float]:
        """How long each connection was (or is still) open, in seconds."""
        now = time.monotonic()
        return [round((c.closed or now) - c.opened, 1) for c in self.connections]

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


def answer_huge(conn: socket.socket, record: Connection, stopping: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % HUGE_BYTES)
    for block in itertools.chain([PREFIX], itertools.repeat(BLOCK, HUGE_BLOCKS), [SERIES + SUFFIX]):
        if stopping.is_set():
            return
        conn.sendall(block)
        record.sent += len(block)


def answer_dripping(conn: socket.socket, record: Connection, stopping: threading.Event) -> None:
    """One byte a second from the status line on, without end (the body is JSON whitespace)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
    for byte in itertools.chain(head, itertools.repeat(ord(" "))):
        readable, _, _ = select.select([conn], [], [], 1.0)  # the pace; a hang-up shows as readable
        if stopping.is_set() or (readable and not conn.recv(1)):
            return
        conn.sendall(bytes([byte]))
        record.sent += 1


class MemorySampler(threading.Thread):
    """The process's VmRSS every 0.1 s (bytes)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[int] = []
        self.stopped = threading.Event()

    def read(self, field: str) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
        except OSError:
            return None
        return None

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            rss = self.read("VmRSS")
            if rss is not None:
                self.samples.append(rss)

    def stop(self) -> None:
        self.stopped.set()
        self.join(5)


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


@dataclass(frozen=True)
class ChartInstall:
    args: tuple[str, ...]
    env: dict[str, str]
    memory_limit: int


def chart_install(allowed_urls: list[str]) -> ChartInstall:
    """The operator container the chart renders with these `prometheus.allowedUrls`: its install flags for
    Prometheus, its worker count and its memory limit."""
    rendered = subprocess.run(
        [str(lc.binaries().helm), "template", "batchtune-test", str(CHART), "--kube-version", "1.36.3",
         "--show-only", "templates/deployment.yaml", "--set-json", f"prometheus.allowedUrls={json.dumps(allowed_urls)}"],
        capture_output=True, text=True, check=True, timeout=60).stdout
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = tuple(a for a in container["args"] if a.startswith("--allowed-prometheus-url="))
    assert len(args) == len(allowed_urls), container["args"]
    env = {e["name"]: e["value"] for e in container["env"] if e["name"] == "BATCHTUNE_WORKERS"}
    return ChartInstall(args, env, quantity_bytes(container["resources"]["limits"]["memory"]))


@pytest.fixture
def hostile() -> Iterator[dict[str, HostileServer]]:
    servers = {"huge": HostileServer(answer_huge), "dripping": HostileServer(answer_dripping)}
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def install(hostile) -> ChartInstall:
    return chart_install([f"{s.url}/" for s in hostile.values()])


@pytest.fixture
def operator(cluster, kube, namespace, kubectl, batchtuning_crd, install, tmp_path):
    grant_operator_rbac(kubectl)
    yield from running_operator(cluster.operator_kubeconfig, kube, namespace, tmp_path, install.args, install.env)


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def ready(kube, namespace: str, name: str) -> bool:
    dep = kube.apps.read_namespaced_deployment(name, namespace)
    return (dep.status.ready_replicas or 0) >= 1


def rolled_out(kube, namespace: str, name: str) -> bool:
    dep = kube.apps.read_namespaced_deployment(name, namespace)
    s = dep.status
    return (s.observed_generation or 0) >= dep.metadata.generation and (s.updated_replicas or 0) == 1 and \
        (s.ready_replicas or 0) == 1 and (s.replicas or 0) == 1


@pytest.mark.timeout(720)  # above its waits (90 s ready, 240 s to Verifying, 60 s to roll back, 90 s to roll out,
# 30 s for the hostile tunings' conditions) and the fixture's 60 s to delete the tunings
def test_a_huge_and_a_dripping_prometheus_neither_stall_a_rollback_nor_take_the_operators_memory(
        kube, namespace, operator, hostile, install, prometheus_url, wait_for):
    kube.apps.create_namespaced_deployment(namespace, production(namespace))
    for name in hostile:  # the hostile tunings' targets: the engine container, no pods
        idle = production(namespace, f"idle-{name}")
        idle["spec"]["replicas"] = 0
        kube.apps.create_namespaced_deployment(namespace, idle)
    wait_for(lambda: ready(kube, namespace, "llm"), timeout=90, what="production ready")
    before = container_of(kube, namespace, "llm")
    memory = MemorySampler(operator.proc.pid)
    memory.start()
    honest = batchtuning(namespace, prometheus_url,
                         searchSpace={"maxNumSeqs": {"values": [16]}, "gpuMemoryUtilizationPercent": [95]},
                         strategy={"type": "Grid", "maxTrials": 1, "maxParallelTrials": 1},
                         objective={"type": "OutputThroughput"},
                         load={"inputTokens": 256, "outputTokens": 64, "concurrency": 4},
                         report={"curveLoad": {"concurrency": 4}},
                         apply={"mode": "Auto", "verifySeconds": VERIFY_SECONDS, "cooldownSeconds": 0,
                                "verifyMinRequests": 10, "maxRegressionPercent": 50})
    kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", honest)
    wait_phase(kube, namespace, "tune", {"Verifying", "Failed", "Succeeded", "RolledBack", "Recommended"}, 240,
               operator)
    # Now the hostile tenants, so their first (and most frequent, before the back-off grows) queries fall in the
    # verify window.
    for name, server in hostile.items():
        spec = batchtuning(namespace, server.url, name=name, target=f"idle-{name}",
                           apply={"mode": "Recommend"})
        kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", spec)
    # Production degrades during verify: far more concurrent users than the setting can serve. It lists the pods every
    # 2 s (production's pod does not change before the rollback): listing before each of 50 requests a second held the
    # GIL and the API server from this test's own poll, which saw the rollback 43 s in where status put it at 15 s.
    flood = Traffic(kube, namespace, "app=llm", rate=50, max_tokens=64, concurrency=80, deadline_s=180,
                    ips_every_s=2.0)
    flood.start()
    try:
        bt = wait_phase(kube, namespace, "tune", {"RolledBack", "Succeeded", "Failed"}, 60, operator)
        seen = time.time()
    finally:
        flood.stop()
    status = bt["status"]
    assert status["phase"] == "RolledBack", json.dumps(status, indent=1)[-2000:]
    assert condition(bt, "Degraded")["reason"] == "Regression", condition(bt, "Degraded")
    applied = status["applied"]
    window_start = at(applied["rolloutCompletedAt"])
    bound = VERIFY_SECONDS + SCRAPE_LAG_SECONDS  # judged once the window, then the scrape lag, have passed
    took, noticed = at(applied["rolledBackAt"]) - window_start, seen - window_start
    assert took <= bound + MARGIN_SECONDS and noticed <= bound + MARGIN_SECONDS + 2, (
        f"rolled back {took:.1f}s (seen {noticed:.1f}s) after the window began; the bound is {bound}s + "
        f"{MARGIN_SECONDS}s; hostile connections held {hostile['dripping'].held()}\n{operator.logs()[-3000:]}")
    # The rollback finishes: production back on its exact previous args, rolled out within the readiness timeout.
    wait_for(lambda: rolled_out(kube, namespace, "llm"), timeout=honest["spec"]["trial"]["readinessTimeoutSeconds"],
             what="production's rollback rolled out")
    assert container_of(kube, namespace, "llm")["args"] == before["args"]

    # The operator's memory stayed under the chart's limit throughout (sampled, and the kernel's high-water mark).
    huge, drip = hostile["huge"], hostile["dripping"]
    peak_hwm = memory.read("VmHWM")
    memory.stop()
    assert memory.samples and peak_hwm is not None
    peak = max(max(memory.samples), peak_hwm)
    print(f"operator RSS: first {memory.samples[0] / 2**20:.0f} MiB, sampled peak {max(memory.samples) / 2**20:.0f} "
          f"MiB, VmHWM {peak_hwm / 2**20:.0f} MiB (limit {install.memory_limit / 2**20:.0f} MiB); huge answers "
          f"{len(huge.connections)}, dripping queries held {drip.held()} s; rolled back {took:.1f} s after the window "
          f"began (bound {bound} s + {MARGIN_SECONDS} s)")
    assert peak < install.memory_limit, (
        f"the operator's RSS peaked at {peak / 2**20:.0f} MiB, over the chart's limit "
        f"{install.memory_limit / 2**20:.0f} MiB")
    # The hostile servers were dialed, and each answer was cut: the huge one read only up to the byte cap, the
    # dripping one let go at the query's deadline (and dialed again after the back-off: the worker was free).
    assert huge.connections and all(c.sent < HUGE_BYTES for c in huge.connections), (
        f"the operator read a whole {HUGE_BYTES}-byte answer: {[c.sent for c in huge.connections]}")
    assert len(drip.connections) >= 2 and max(drip.held()) <= QUERY_DEADLINE_SECONDS + HOLD_MARGIN_SECONDS, (
        f"the dripping server's connections were held {drip.held()} s; the query deadline is "
        f"{QUERY_DEADLINE_SECONDS:g} s")
    for name in hostile:
        wait_status(kube, namespace, name, lambda s: any(
            c["type"] == "Degraded" and c["reason"] == "PrometheusUnreachable" for c in s.get("conditions") or []),
            30, operator, "Degraded with PrometheusUnreachable")
    assert "deadline" in condition(get_bt(kube, namespace, "dripping"), "Degraded")["message"]
    assert "bytes" in condition(get_bt(kube, namespace, "huge"), "Degraded")["message"]

    assert operator.alive()
