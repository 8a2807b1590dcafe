"""The scrape interval, found out: `core.scrape` (durations, targets, configuration) and the reader asking a
Prometheus played by a loopback server that answers the query, targets and configuration endpoints."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from batchtune.core.promql import LabelNames, MetricNames, QueryContext
from batchtune.core.scrape import assumed, from_config, from_targets, parse_duration
from batchtune.engines import VLLM
from batchtune.prometheus import Production, PrometheusReader, PrometheusUnavailable


@pytest.mark.parametrize("text, seconds", [
    ("15s", 15), ("2s", 2), ("1m", 60), ("1m30s", 90), ("500ms", 0.5), ("1h", 3600), ("1.5s", 1.5),
    ("", None), ("15", None), ("s", None), ("0s", None), ("15s junk", None), (None, None), (15, None),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


def target(job: str, interval: str, pool: str | None = None) -> dict:
    return {"labels": {"job": job, "instance": "x"}, "scrapePool": pool or job, "scrapeInterval": interval}


def test_the_longest_interval_of_the_jobs_targets_wins():
    targets = [target("pods", "2s"), target("pods", "5s"), target("other", "60s"), {"labels": "junk"},
               target("pods", "bogus")]
    assert from_targets(targets, {"pods"}) == 5
    assert from_targets(targets, {"nothing"}) is None
    assert from_targets([target("relabelled", "10s", pool="pods")], {"pods"}) == 10


@pytest.mark.parametrize("config, jobs, seconds", [
    pytest.param({"global": {"scrape_interval": "2s"}}, (), 2, id="global"),
    pytest.param({"global": {}}, (), 60, id="prometheus-default"),
    pytest.param({"global": {"scrape_interval": "15s"},
                  "scrape_configs": [{"job_name": "pods", "scrape_interval": "5s"}, {"job_name": "x"}]},
                 {"pods"}, 5, id="the-jobs-own"),
    pytest.param({"global": {"scrape_interval": "15s"}, "scrape_configs": [{"job_name": "pods"}]},
                 {"pods"}, 15, id="the-job-inherits-the-global"),
    pytest.param({"global": {"scrape_interval": "15s"}, "scrape_configs": []}, {"pods"}, None, id="job-not-there"),
    pytest.param({"global": {"scrape_interval": "soon"}}, (), None, id="unreadable"),
])
def test_from_config(config, jobs, seconds):
    assert from_config(config, jobs) == seconds


def test_an_assumed_interval_says_why_and_what_to_set():
    found = assumed("no answer")
    assert found.seconds == 15 and "assumed: no answer" in found.source
    assert "prometheus.scrapeIntervalSeconds" in found.source


# ---- the reader against a Prometheus on loopback ------------------------------------------------------


class Routes(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, object]] = {}
    seen: list[tuple[str, dict]] = []

    def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
        url = urlsplit(self.path)
        params = {k: v[0] for k, v in parse_qs(url.query).items()}
        Routes.seen.append((url.path, params))
        status, body = Routes.routes.get(url.path, (404, {"status": "error"}))
        if callable(body):
            body = body(params)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body).encode() if not isinstance(body, bytes) else body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    Routes.routes, Routes.seen = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def reader(url: str) -> PrometheusReader:
    ctx = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(model=None), 95)
    return PrometheusReader(url, ctx, timeout_s=5, loopback_allowed=True)


def jobs_answer(*jobs: str) -> tuple[int, object]:
    return 200, {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"job": j}, "value": [0, "1"]} for j in jobs]}}


def targets_answer(*targets: dict) -> tuple[int, object]:
    return 200, {"status": "success", "data": {"activeTargets": list(targets), "droppedTargets": []}}


def config_answer(text: str) -> tuple[int, object]:
    return 200, {"status": "success", "data": {"yaml": text}}


PROD = Production("ns", ("llm-0",))


def test_the_job_scraping_the_pods_names_the_interval(prometheus):
    Routes.routes = {"/api/v1/query": jobs_answer("kubernetes-pods"),
                     "/api/v1/targets": targets_answer(target("kubernetes-pods", "2s"), target("kubernetes-pods", "3s")),
                     "/api/v1/status/config": config_answer("global:\n  scrape_interval: 60s\n")}
    found = reader(prometheus).scrape_interval(PROD, "Deployment ns/llm")
    assert found is not None and found.seconds == 3
    assert found.source == "Prometheus' targets API: job kubernetes-pods scrapes Deployment ns/llm's pods"
    query = next(p["query"] for path, p in Routes.seen if path == "/api/v1/query")
    assert query.startswith("count by (job) (vllm:num_requests_running{") and 'namespace="ns",pod=~"llm-0"' in query
    assert ("/api/v1/targets", {"state": "active", "scrapePool": "kubernetes-pods"}) in Routes.seen


def test_without_series_of_the_pods_the_configured_global_interval_is_used(prometheus):
    Routes.routes = {"/api/v1/query": jobs_answer(),
                     "/api/v1/status/config": config_answer("global:\n  scrape_interval: 2s\nscrape_configs: []\n")}
    found = reader(prometheus).scrape_interval(PROD, "Deployment ns/llm")
    assert found is not None and found.seconds == 2
    assert "the global scrape_interval (Deployment ns/llm has no series yet" in found.source
    assert not [p for p, _ in Routes.seen if p == "/api/v1/targets"]


def test_a_job_the_targets_api_does_not_list_is_read_from_the_configuration(prometheus):
    Routes.routes = {"/api/v1/query": jobs_answer("pods"), "/api/v1/targets": targets_answer(),
                     "/api/v1/status/config": config_answer(
                         "global:\n  scrape_interval: 15s\nscrape_configs:\n- job_name: pods\n  scrape_interval: 5s\n")}
    found = reader(prometheus).scrape_interval(PROD, "Deployment ns/llm")
    assert found is not None and found.seconds == 5 and "job pods's scrape_interval" in found.source


@pytest.mark.parametrize("routes", [
    pytest.param({}, id="neither-endpoint"),
    pytest.param({"/api/v1/status/config": (200, {"status": "success", "data": {"yaml": "global: [not, a, map"}})},
                 id="unreadable-yaml"),
    pytest.param({"/api/v1/status/config": (200, b"<html>proxy</html>")}, id="not-json"),
    pytest.param({"/api/v1/status/config": (403, {"status": "error"})}, id="forbidden"),
])
def test_a_prometheus_that_does_not_say_gives_none(prometheus, routes):
    Routes.routes = {"/api/v1/query": jobs_answer(), **routes}
    assert reader(prometheus).scrape_interval(PROD, "Deployment ns/llm") is None


def test_an_oversized_answer_is_not_read(prometheus):
    Routes.routes = {"/api/v1/query": jobs_answer(),
                     "/api/v1/status/config": config_answer("global:\n  scrape_interval: 2s\n#" + "x" * 100)}
    r = reader(prometheus)
    r.API_BYTES_LIMIT = 64
    assert r.scrape_interval(PROD, "Deployment ns/llm") is None


def test_an_unreachable_prometheus_is_unavailable_not_assumed():
    with pytest.raises(PrometheusUnavailable):
        reader("http://127.0.0.1:9").scrape_interval(Production("ns", ()), "Deployment ns/llm")
