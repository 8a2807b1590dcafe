"""Prometheus discovers pods through the API server and scrapes those that declare it, labelled by pod."""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request

import pytest

pytestmark = pytest.mark.integration

# Serves one gauge on $BATCHTUNE_POD_IP:<port> at every path; the node agent sets the pod IP.
EXPORTER = """
import http.server, os, sys
port = int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ('batchtune_probe_path{path="%s"} 1\\n' % self.path).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer((os.environ["BATCHTUNE_POD_IP"], port), H).serve_forever()
"""


def _pod(name: str, *, port: int, port_name: str | None = None, annotations: dict[str, str] | None = None):
    container = {"name": "exporter", "image": "batchtune.test/exporter",
                 "command": [sys.executable, "-c", EXPORTER, str(port)]}
    if port_name:
        container["ports"] = [{"name": port_name, "containerPort": port}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 1}}


def _query(prometheus_url: str, promql: str) -> list[dict]:
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def test_pods_that_declare_metrics_are_scraped_with_pod_labels(kube, namespace, prometheus_url, wait_for):
    if not kube.core.list_node().items:
        pytest.fail("no nodes: the node agent is not running in the local cluster", pytrace=False)
    pods = {
        "annotated": _pod("annotated", port=9100, annotations={
            "prometheus.io/scrape": "true", "prometheus.io/port": "9100", "prometheus.io/path": "/custom"}),
        "named-port": _pod("named-port", port=9200, port_name="metrics"),
        "undeclared": _pod("undeclared", port=9300, port_name="grpc"),
        "opted-out": _pod("opted-out", port=9400, port_name="metrics", annotations={"prometheus.io/scrape": "false"}),
    }
    for body in pods.values():
        kube.core.create_namespaced_pod(namespace, body)

    def scraped() -> dict[str, dict]:
        series = _query(prometheus_url, f'batchtune_probe_path{{namespace="{namespace}"}}')
        by_pod = {s["metric"]["pod"]: s["metric"] for s in series}
        return by_pod if {"annotated", "named-port"} <= by_pod.keys() else {}

    by_pod = wait_for(scraped, timeout=60, interval=1, what=f"pod series in namespace {namespace}")
    assert by_pod["annotated"]["path"] == "/custom"
    assert by_pod["named-port"]["path"] == "/metrics"
    for name in ("annotated", "named-port"):
        assert by_pod[name]["namespace"] == namespace
        assert by_pod[name]["container"] == "exporter"
        assert by_pod[name]["job"] == "kubernetes-pods"
    # Undeclared and opted-out pods run too, but Prometheus must not scrape them.
    assert kube.core.read_namespaced_pod("undeclared", namespace).status.phase == "Running"
    assert kube.core.read_namespaced_pod("opted-out", namespace).status.phase == "Running"
    assert not {"undeclared", "opted-out"} & by_pod.keys()
    with urllib.request.urlopen(f"{prometheus_url}/api/v1/targets?state=active", timeout=5) as response:
        targets = json.load(response)["data"]["activeTargets"]
    ours = {t["labels"].get("pod") for t in targets if t["labels"].get("namespace") == namespace}
    assert ours == {"annotated", "named-port"}, ours
