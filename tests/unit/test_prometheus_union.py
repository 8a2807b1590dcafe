"""A trial run's figures read as a few labelled unions (`promql.unions`) equal each query read alone, on a real
Prometheus (the local cluster's build) scraping a vLLM exposition whose counters grow at every scrape."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from batchtune.core import promql
from batchtune.core.measurement import Window
from batchtune.core.promql import LabelNames, MetricNames, QueryContext
from batchtune.core.vocabulary import M
from batchtune.engines import VLLM
from batchtune.prometheus import PrometheusReader
from batchtune_local.binaries import binaries

pytestmark = pytest.mark.binaries  # prometheus from hack/localcluster/build: hack/test-suite runs these after the build

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "vllm-0.32.0-cpu" / "metrics.txt"
MODEL = "tiny-llama-v1"  # the golden scrape's model_name


def exposition(scrape: int) -> bytes:
    """The golden scrape with its counters and histograms grown `scrape` times, and its request gauges moving."""
    out = []
    for line in GOLDEN.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            out.append(line)
            continue
        series, value = line.rsplit(" ", 1)
        name, number = series.split("{")[0], float(value)
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            number = number * scrape + scrape * (3 if name.endswith("_sum") else 1)
        elif name.startswith(("vllm:num_requests", "vllm:kv_cache")):
            number = (scrape % 5) / 10 + (1 if "running" in name else 0)
        out.append(f"{series} {number}")
    return ("\n".join(out) + "\n").encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[str]:
    binary = binaries().prometheus
    if not os.access(binary, os.X_OK):
        pytest.fail(f"prometheus not found at {binary}: run `make binaries`", pytrace=False)
    scrapes = [0]

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
            scrapes[0] += 1
            body = exposition(scrapes[0])
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    engine = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: engine\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{engine.server_address[1]}'], "
        "labels: {namespace: ns, pod: pod}}]\n")
    with open(tmp_path / "prometheus.log", "w") as log:
        proc = subprocess.Popen([str(binary), f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while scrapes[0] < 12:  # a 10 s window of 1 s scrapes
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prometheus did not scrape: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(2)  # the last scrapes stored
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        engine.shutdown()


def test_the_unions_read_what_each_query_alone_reads(prometheus):
    ctx = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(), 95)
    reader = PrometheusReader(prometheus, ctx, timeout_s=10, loopback_allowed=True)
    end = datetime.now(UTC) - timedelta(seconds=2)
    window = Window(end - timedelta(seconds=8), end)
    together = reader.trial_run("ns", "pod", MODEL, window)
    at = window.end.timestamp()
    queries = promql.trial_queries(ctx, "ns", "pod", MODEL, window.seconds)
    alone: dict[str, float | None] = {key: reader.scalar(text, at) for key, text in queries.items()}
    pool = reader.vector(promql.kv_pool_query(ctx, "ns", "pod"), at)
    alone[M.KV_POOL_TOKENS] = float(pool[0][0]["num_gpu_blocks"]) * float(pool[0][0]["block_size"])
    assert together == alone
    # The engine's figures are there (the golden scrape has no GPU exporter: those are unknown either way).
    assert all(together[key] is not None for key in (M.TTFT_MS, M.ITL_MS, M.E2E_MS, M.OUTPUT_THROUGHPUT,
                                                      M.RUNNING_REQUESTS, M.KV_CACHE_USAGE_PERCENT, M.WAITING_GROWTH,
                                                      M.KV_POOL_TOKENS))
    assert len(promql.unions({**queries, M.KV_POOL_TOKENS: promql.kv_pool_query(ctx, "ns", "pod")})) > 1
