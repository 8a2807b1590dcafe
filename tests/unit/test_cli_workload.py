"""`batchtune workload capture`: a Deployment's profile from a (fake) API server and a (fake) Prometheus."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import cli_fakes
import pytest

from batchtune.cli import main
from batchtune.loadgen.workload import parse_trace

NS = "inference"
LE = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "+Inf"]


def _cumulative(per_bucket: dict[str, float]) -> list[tuple[str, float]]:
    running, out = 0.0, []
    for le in LE:
        running += per_bucket.get(le, 0.0)
        out.append((le, running))
    return out


PROMPTS = _cumulative({"100.0": 600.0, "200.0": 400.0})
OUTPUTS = _cumulative({"50.0": 500.0, "100.0": 500.0})


class Prometheus:
    """Answers the workload queries: buckets, means, a per-minute count series, no prefix cache."""

    def __init__(self, requests: float = 1000.0) -> None:
        self.queries: list[str] = []
        scale = requests / 1000.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                query = parse_qs(urlsplit(self.path).query).get("query", [""])[0]
                fake.queries.append(query)
                if "_bucket" in query:
                    pairs = PROMPTS if "prompt" in query else OUTPUTS
                    result = [{"metric": {"le": le}, "value": [0, str(v * scale)]} for le, v in pairs]
                    body = {"resultType": "vector", "result": result}
                elif "_sum" in query:
                    body = {"resultType": "vector", "result": [{"metric": {}, "value": [0, "140"]}]}
                elif query.endswith("s]") and ":" in query.rsplit("[", 1)[1]:
                    values = [[60 * i, str(requests / 60)] for i in range(60)]
                    body = {"resultType": "matrix", "result": [{"metric": {}, "values": values}]}
                else:
                    body = {"resultType": "vector", "result": []}
                data = json.dumps({"status": "success", "data": body}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def api(tmp_path):
    fake = cli_fakes.FakeApi()
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llm", "namespace": NS},
                  "spec": {"selector": {"matchLabels": {"app": "llm"}}, "template": {"spec": {"containers": [
                      {"name": "vllm", "image": "vllm/vllm-openai", "command": ["vllm", "serve", "m"],
                       "args": ["--max-num-seqs", "64"]}]}}}}
    fake.routes[f"/apis/apps/v1/namespaces/{NS}/deployments/llm"] = (200, deployment)
    fake.routes[f"/api/v1/namespaces/{NS}/pods"] = (200, {"kind": "PodList", "items": [
        {"metadata": {"name": "llm-abc", "labels": {"app": "llm"}}},
        {"metadata": {"name": "tune-trial-3-x", "labels": {"app": "llm", "batchtune.io/tuning": "tune"}}}]})
    yield fake, str(fake.kubeconfig(tmp_path / "kubeconfig", NS))
    fake.close()


def capture(api, prometheus, *extra: str) -> list[str]:
    return ["workload", "capture", "llm", "--kubeconfig", api[1], "--prometheus", prometheus.url, *extra]


def test_the_summary_names_rate_and_lengths(api, capsys):
    prometheus = Prometheus()
    try:
        assert main(capture(api, prometheus)) == 0
    finally:
        prometheus.close()
    out = capsys.readouterr().out
    assert out.startswith("production over 1h (1000 requests): 0.278 req/s mean, 0.278 peak")
    assert "prompt mean 140" in out
    joined = "\n".join(prometheus.queries)
    assert 'pod=~"llm\\\\-abc"' in joined or 'pod=~"llm-abc"' in joined
    assert "tune-trial" not in joined  # the tuning's own trial pods are never production


def test_the_profile_is_status_workload_shaped_and_honours_metric_names(api, capsys):
    prometheus = Prometheus()
    try:
        assert main(capture(api, prometheus, "-o", "profile", "--metric-name",
                            "requestGenerationTokens=my:out_len", "--lookback", "7200")) == 0
    finally:
        prometheus.close()
    profile = json.loads(capsys.readouterr().out)
    assert profile["source"] == "production" and profile["lookbackSeconds"] == 7200
    assert profile["promptLengths"]["p50"] == pytest.approx(50 + 50 * 500 / 600, abs=0.1)
    assert any("my:out_len_bucket" in q for q in prometheus.queries)


def test_a_trace_has_the_profiles_shape_and_reads_back(api, capsys):
    prometheus = Prometheus()
    try:
        assert main(capture(api, prometheus, "-o", "trace", "--requests", "300", "--seed", "4")) == 0
    finally:
        prometheus.close()
    captured = capsys.readouterr()
    trace = parse_trace(captured.out.splitlines())
    assert len(trace) == 300 and all(50 < r.prompt_tokens <= 200 for r in trace)
    assert all(1 <= r.output_tokens <= 100 for r in trace)
    assert trace[-1].offset_seconds / 299 == pytest.approx(3.6, rel=0.3)  # 1000 requests an hour
    assert "create configmap llm-trace --from-file=trace.jsonl=FILE" in captured.err


def test_too_little_traffic_is_an_error_not_a_profile(api, capsys):
    prometheus = Prometheus(requests=40)
    try:
        assert main(capture(api, prometheus)) == 1
    finally:
        prometheus.close()
    assert "served 40 request(s) in the last 1h; a profile needs at least 100" in capsys.readouterr().err


def test_a_missing_deployment_is_named(api, capsys):
    prometheus = Prometheus()
    try:
        assert main(["workload", "capture", "nope", "--kubeconfig", api[1], "--prometheus", prometheus.url]) == 1
    finally:
        prometheus.close()
    assert 'Deployment "nope" not found in namespace "inference"' in capsys.readouterr().err


def test_a_bad_metric_override_is_named(api, capsys):
    prometheus = Prometheus()
    try:
        assert main(capture(api, prometheus, "--metric-name", "noSuchRole=x")) == 1
    finally:
        prometheus.close()
    assert "prometheus.metricNames.noSuchRole: unknown metric key" in capsys.readouterr().err
