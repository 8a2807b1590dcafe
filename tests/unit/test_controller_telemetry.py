"""The operator's own metrics (controller/telemetry.py): each one moves when what it counts happens, and the served
/metrics page carries them all (what the chart's ServiceMonitor scrapes and its dashboard reads)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kopf
import pytest
from fake_world import reset_backoff, world
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from batchtune.controller import telemetry


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


@pytest.fixture(autouse=True)
def _fresh_backoff():
    reset_backoff()
    yield
    reset_backoff()


def test_trials_and_the_tuning_duration_count_a_whole_tuning():
    done, durations = value("batchtune_trials_total", result="Done"), value("batchtune_tuning_duration_seconds_count")
    w = world()
    assert w.run_until({"Succeeded", "Failed", "RolledBack"}) == "Succeeded"
    finished = sum(1 for t in w.status["trials"] if t["state"] == "Done")
    assert finished >= 2
    assert value("batchtune_trials_total", result="Done") - done == finished
    assert value("batchtune_tuning_duration_seconds_count") - durations == 1


def test_a_rollback_is_counted():
    from test_reconcile import degrade_after_change

    before = value("batchtune_rollbacks_total")
    w = world()
    degrade_after_change(w)
    assert w.run_until({"Succeeded", "Failed", "RolledBack"}) == "RolledBack"
    assert value("batchtune_rollbacks_total") - before == 1


class Silent(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  # the stdlib's name
        self.send_response(500)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def broken_prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_prometheus_queries_and_their_failures_are_counted(broken_prometheus):
    from batchtune.controller.handlers import PrometheusMetrics
    from batchtune.core.policy import prometheus_url_check
    from batchtune.core.promql import LabelNames, MetricNames, QueryContext
    from batchtune.engines import VLLM
    from batchtune.prometheus import PrometheusUnavailable

    queries, errors = value("batchtune_prometheus_queries_total"), value("batchtune_prometheus_query_errors_total")
    ctx = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(model=None), 95)
    # The reader takes what the policy allowed; the test's Prometheus is on loopback, so the install names it.
    url = prometheus_url_check(broken_prometheus, [broken_prometheus])
    reader = PrometheusMetrics().reader(url, None, ctx, VLLM, "uid-1")
    for _ in range(3):
        with pytest.raises(PrometheusUnavailable):
            reader.ping()
    assert value("batchtune_prometheus_queries_total") - queries == 3
    assert value("batchtune_prometheus_query_errors_total") - errors == 3


def test_each_timer_run_is_timed(monkeypatch):
    from batchtune.controller import handlers, kube

    events: list[str] = []
    monkeypatch.setattr(kube.KubeCluster, "event", lambda self, *args: events.append(args[4]))  # no kopf context here

    before = value("batchtune_reconcile_seconds_count")
    body = kopf.Body({"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
                      "metadata": {"name": "bad", "namespace": "ns", "uid": "u1", "generation": 1},
                      "spec": {"targetRef": {}}, "status": {}})
    patch = kopf.Patch()
    indexes = {"owned_deployments": {}, "owned_jobs": {}, "batchtune_pods": {}}
    asyncio.run(handlers.tick(body=body, patch=patch, logger=logging.getLogger("test"), **indexes))
    assert patch["status"]["phase"] == "Failed" and events == ["InvalidSpec"]  # decided in one tick
    assert value("batchtune_reconcile_seconds_count") - before == 1
    assert value("batchtune_reconcile_seconds_bucket", le="+Inf") >= 1


def test_metrics_are_served_with_help_for_every_family():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    telemetry.serve(port, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("batchtune_")}
    assert {"batchtune_trials", "batchtune_tuning_duration_seconds", "batchtune_prometheus_query_errors",
            "batchtune_prometheus_queries", "batchtune_reconcile_seconds", "batchtune_rollbacks", "batchtune_leader",
            "batchtune_leader_acquired"} <= set(families)
    assert all(f.documentation for f in families.values())
    assert families["batchtune_reconcile_seconds"].type == "histogram"
    assert families["batchtune_leader"].type == "gauge"
