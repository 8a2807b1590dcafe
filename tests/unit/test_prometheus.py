"""The Prometheus reader against answers a real Prometheus gives only when something is wrong.

A small HTTP server on loopback plays Prometheus: a 200 with an error body, missing or null `data`,
a scalar, a matrix, several series where one was asked, NaN, +Inf, HTTP 500 and 400, garbage. None
of them may crash a tick, and none may read as a number that passes.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from batchtune.controller.handlers import http_errors
from batchtune.core.measurement import Window
from batchtune.core.promql import LabelNames, MetricNames, QueryContext
from batchtune.core.vocabulary import M
from batchtune.engines import VLLM
from batchtune.prometheus import Production, PrometheusReader, PrometheusUnavailable


class FakePrometheus(BaseHTTPRequestHandler):
    answer: tuple[int, bytes] = (200, b"")
    queries: list[str] = []

    def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
        from urllib.parse import parse_qs, urlsplit

        FakePrometheus.queries.append(parse_qs(urlsplit(self.path).query).get("query", [""])[0])
        status, body = FakePrometheus.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def reader(url: str) -> PrometheusReader:
    ctx = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(model=None), 95)
    return PrometheusReader(url, ctx, timeout_s=5, loopback_allowed=True, finished_reason_label="finished_reason",
                            error_reasons=("abort", "error"), http_errors=http_errors(VLLM.metrics))


def answer(body: object, status: int = 200) -> None:
    FakePrometheus.answer = (status, body if isinstance(body, bytes) else json.dumps(body).encode())


def vector(*values: str) -> dict:
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": {"i": str(i)}, "value": [1.0, v]} for i, v in enumerate(values)]}}


@pytest.mark.parametrize("body, status", [
    pytest.param({"status": "error", "errorType": "internal", "error": "\x1b[31mboom\x1b[0m " + "x" * 5000}, 200,
                 id="200-with-an-error-body"),
    pytest.param({"status": "success"}, 200, id="no-data"),
    pytest.param({"status": "success", "data": None}, 200, id="null-data"),
    pytest.param({"status": "success", "data": {"resultType": "scalar", "result": [1.0, "3"]}}, 200, id="scalar"),
    pytest.param(b"<html>not json</html>", 200, id="not-json"),
    pytest.param({"status": "error", "error": "storage down"}, 500, id="http-500"),
    pytest.param({"status": "error", "error": "bad_data"}, 400, id="http-400"),
])
def test_a_broken_answer_is_unavailable_with_a_short_clean_message(prometheus, body, status):
    answer(body, status)
    with pytest.raises(PrometheusUnavailable) as caught:
        reader(prometheus).scalar("vector(1)")
    message = str(caught.value)
    assert len(message) < 200 and "\x1b" not in message and "boom" not in message


@pytest.mark.parametrize("values, expected", [
    pytest.param(("12.5",), 12.5, id="one-series"),
    pytest.param((), None, id="empty-is-unknown"),
    pytest.param(("NaN",), None, id="nan-is-unknown"),
    pytest.param(("+Inf",), math.inf, id="inf-stays-inf"),
    pytest.param(("1", "900"), None, id="several-series-are-unknown-never-the-largest"),
])
def test_values(prometheus, values, expected):
    answer(vector(*values))
    assert reader(prometheus).scalar("up") == expected


def test_a_trial_run_with_nothing_in_prometheus_is_all_unknown(prometheus):
    answer(vector())
    now = datetime(2026, 12, 1, 8, tzinfo=UTC)
    values = reader(prometheus).trial_run("ns", "pod", "m", Window(now - timedelta(seconds=60), now))
    assert set(values.values()) == {None}
    assert M.TTFT_MS in values and M.WAITING_GROWTH in values and M.GPUS in values


def test_production_counts_fast_failures_and_the_served_share(prometheus):
    FakePrometheus.queries = []
    answers = {"failedThroughput": "0.2", "httpFailedThroughput": "0.8", "requestThroughput": "9.2",
               "inSystemGrowth": "30"}

    def route(query: str) -> dict:
        if "http_requests_total" in query:
            value = answers["httpFailedThroughput"]
        elif 'finished_reason=~"abort|error"' in query:
            value = answers["failedThroughput"]
        elif "offset" in query:
            value = answers["inSystemGrowth"]
        elif "sum(rate(vllm:request_success_total" in query:
            value = answers["requestThroughput"]
        else:
            value = "NaN"
        return vector(value)

    server = _routed_server(route)
    try:
        now = datetime(2026, 12, 1, 8, tzinfo=UTC)
        out = reader(f"http://127.0.0.1:{server.server_address[1]}").production_window(
            Production("ns", ("p-0",)), now - timedelta(seconds=60), now)
    finally:
        server.shutdown()
    # 0.2 failed finishes plus 0.8 fast HTTP failures over 9.2 + 0.8 answered requests.
    assert out[M.ERROR_RATE_PERCENT] == pytest.approx(10.0)
    # 30 more requests in the system after 60 s: 0.5/s arrived and were not served.
    assert out["servedSharePercent"] == pytest.approx(100 * 9.2 / 9.7, abs=0.01)


def models(*names: str) -> dict:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"modelName": n} if n else {}, "value": [1.0, "1"]} for n in names]}}


@pytest.mark.parametrize("body, expected", [
    pytest.param(models("NVIDIA H100 80GB HBM3"), "NVIDIA H100 80GB HBM3", id="one-model"),
    pytest.param(models("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"), None, id="two-models-is-no-answer"),
    pytest.param(models(""), None, id="no-label"),
    pytest.param(models(), None, id="no-series"),
    pytest.param(models("NVIDIA \x1b[31mH100"), "NVIDIA  [31mH100", id="escapes-sanitised"),
])
def test_the_gpu_model_is_dcgms_one_model_name_for_production_pods(prometheus, body, expected):
    FakePrometheus.queries = []
    answer(body)
    assert reader(prometheus).production_gpu_model(Production("ns", ("llm-0", "llm-1"))) == expected
    assert FakePrometheus.queries == ['count by (modelName) (DCGM_FI_DEV_GPU_UTIL{namespace="ns",pod=~"llm-0|llm-1"})']


def test_no_production_pod_asks_nothing(prometheus):
    FakePrometheus.queries = []
    assert reader(prometheus).production_gpu_model(Production("ns", ())) is None
    assert FakePrometheus.queries == []


def _routed_server(route):
    """A Prometheus on loopback that answers each query with `route(query)` (a JSON-able body)."""
    def routed_get(self: BaseHTTPRequestHandler) -> None:
        from urllib.parse import parse_qs, urlsplit

        query = parse_qs(urlsplit(self.path).query).get("query", [""])[0]
        FakePrometheus.queries.append(query)
        body = json.dumps(route(query)).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), type("W", (FakePrometheus,), {"do_GET": routed_get}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _le_vector(pairs):
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"le": le}, "value": [1.0, str(v)]} for le, v in pairs]}}


def _matrix(*series):
    return {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {}, "values": [[1000.0 + 60 * i, str(v)] for i, v in enumerate(values)]} for values in series]}}


# The buckets of the real scrape (metrics-exposition.txt), as increases over the lookback.
REAL_LE = [("1.0", 0), ("2.0", 0), ("5.0", 1), ("10.0", 2), ("20.0", 2), ("50.0", 3), ("100.0", 3), ("200.0", 3),
           ("500.0", 3), ("1000.0", 3), ("2000.0", 3), ("+Inf", 3)]


def test_production_workload_reads_buckets_means_the_rate_series_and_prefix_cache(prometheus):
    FakePrometheus.queries = []

    def route(query: str) -> dict:
        if "request_prompt_tokens_bucket" in query or "request_generation_tokens_bucket" in query:
            return _le_vector(REAL_LE + [("junk", 7)])
        if "_sum" in query:
            return vector("12.0")
        if query.endswith("[3600s:60s]"):
            return _matrix(["1", "NaN", "2", "0"])
        if "prefix_cache_hits" in query:
            return vector("25")
        if "prefix_cache_queries" in query:
            return vector("100")
        return vector()

    server = _routed_server(route)
    try:
        obs = reader(f"http://127.0.0.1:{server.server_address[1]}").production_workload(
            Production("ns", ("llm-0", "llm-1")), 3600, 60)
    finally:
        server.shutdown()
    assert obs is not None and obs.lookback_seconds == 3600 and obs.window_seconds == 60
    assert obs.prompt_buckets[-1] == (math.inf, 3.0) and len(obs.prompt_buckets) == 12  # "junk" left out
    assert obs.prompt_mean == 12.0 and obs.request_counts == (1.0, 2.0, 0.0)
    assert (obs.prefix_cache_hits, obs.prefix_cache_queries) == (25.0, 100.0)
    joined = "\n".join(FakePrometheus.queries)
    assert 'pod=~"llm-0|llm-1"' in joined and 'namespace="ns"' in joined
    assert "vllm:gpu_prefix_cache_hits_total" in joined  # the older name, queried as `or`


def test_production_workload_uses_the_configured_metric_names(prometheus):
    FakePrometheus.queries = []
    server = _routed_server(lambda query: vector())
    ctx = QueryContext(MetricNames.build(VLLM.metrics, {"requestPromptTokens": "my:prompt_len",
                                                        "prefixCacheHits": "my:hits"}),
                       LabelNames(pod="kubernetes_pod_name"), LabelNames(model=None), 95)
    try:
        obs = PrometheusReader(f"http://127.0.0.1:{server.server_address[1]}", ctx, timeout_s=5, loopback_allowed=True) \
            .production_workload(Production("ns", ("p",)), 7200, 120)
    finally:
        server.shutdown()
    joined = "\n".join(FakePrometheus.queries)
    assert "my:prompt_len_bucket" in joined and "vllm:request_prompt_tokens" not in joined
    assert "my:hits" in joined and "gpu_prefix_cache_hits" not in joined  # an override drops the alias
    assert "kubernetes_pod_name" in joined and "[7200s:120s]" in joined
    assert obs is not None and obs.prompt_buckets == () and obs.request_counts == ()


def test_production_workload_with_several_rate_series_is_no_series(prometheus):
    server = _routed_server(lambda q: _matrix(["1", "2"], ["3", "4"]) if q.endswith("s]") and ":" in q.rsplit("[", 1)[1]
                            else vector())
    try:
        obs = reader(f"http://127.0.0.1:{server.server_address[1]}").production_workload(Production("ns", ("p",)),
                                                                                          3600, 60)
    finally:
        server.shutdown()
    assert obs is not None and obs.request_counts == ()


def test_production_workload_without_pods_is_none(prometheus):
    assert reader(prometheus).production_workload(Production("ns", ()), 3600, 60) is None


def test_a_trial_run_reads_its_26_figures_in_a_few_requests_each_figure_by_its_label(prometheus):
    """The window's queries go as `promql.unions` (on a starved machine each round trip waited for a CPU); each
    figure reads back what its query alone would give: one series, none, two (unknown), NaN (unknown)."""
    import re

    FakePrometheus.queries = []

    def route(query: str) -> dict:
        result = []
        for key in re.findall(r'"batchtune_figure", "(\w+)", "", ""\)', query):
            labels = {"batchtune_figure": key}
            if key == M.TTFT_MS:
                result.append({"metric": labels, "value": [1.0, "123.5"]})
            elif key == M.ITL_MS:  # two series where one was asked
                result += [{"metric": {**labels, "pod": p}, "value": [1.0, "7"]} for p in ("a", "b")]
            elif key == M.GPUS:
                result.append({"metric": labels, "value": [1.0, "NaN"]})
            elif key == M.OUTPUT_THROUGHPUT:
                result.append({"metric": labels, "value": [1.0, "880"]})
            elif key == M.KV_POOL_TOKENS:
                result.append({"metric": {**labels, "num_gpu_blocks": "100", "block_size": "16"}, "value": [1.0, "1"]})
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    server = _routed_server(route)
    now = datetime(2026, 12, 1, 8, tzinfo=UTC)
    try:
        values = reader(f"http://127.0.0.1:{server.server_address[1]}").trial_run(
            "ns", "pod", "m", Window(now - timedelta(seconds=60), now))
    finally:
        server.shutdown()
    from batchtune.core.promql import UNION_CHARS

    assert 1 < len(FakePrometheus.queries) <= 3 and all(len(q) <= UNION_CHARS for q in FakePrometheus.queries)
    assert values[M.TTFT_MS] == 123.5 and values[M.OUTPUT_THROUGHPUT] == 880.0
    assert values[M.ITL_MS] is None and values[M.GPUS] is None and values[M.E2E_MS] is None
    assert values[M.KV_POOL_TOKENS] == 1600.0
    assert set(values) == {*promql_keys(), M.KV_POOL_TOKENS}


def promql_keys() -> set[str]:
    from batchtune.core.promql import trial_queries

    ctx = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(model=None), 95)
    return set(trial_queries(ctx, "ns", "pod", "m", 60))


def test_unions_keep_every_query_whole_within_the_limit_and_refuse_a_key_that_is_no_label_value():
    from batchtune.core.promql import unions

    queries = {f"q{i}": f"sum(rate(metric_{i}_total[60s]))" for i in range(40)}
    joined = unions(queries, limit=300)
    assert len(joined) > 1 and all(len(text) <= 300 for text in joined)
    for key, query in queries.items():
        assert sum(f'label_replace({query}, "batchtune_figure", "{key}", "", "")' in text for text in joined) == 1
    assert unions({"long": "x" * 500}, limit=300) == ['label_replace(' + "x" * 500 + ', "batchtune_figure", "long", "", "")']
    with pytest.raises(ValueError, match="'p95\"'"):
        unions({'p95"': "up"})
