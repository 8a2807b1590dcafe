"""Services of type LoadBalancer on the local cluster (batchtune_local.servicelb): traffic follows ready pods.

The demo's production traffic goes through such a Service, so an Auto rollout moves it to the new pod
and verify reads production's real metrics. These tests pin that on the real control plane.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.integration

SERVER = (
    "import http.server, os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = (os.environ['HOSTNAME'] + ' ' + os.environ.get('VERSION', '')).encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "http.server.ThreadingHTTPServer((os.environ['BATCHTUNE_POD_IP'], 8080), H).serve_forever()\n"
)


def deployment(name: str, replicas: int, version: str) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "terminationGracePeriodSeconds": 2,
                     "containers": [{"name": "web", "image": "batchtune.test/web", "command": ["python3", "-c", SERVER],
                                     "env": [{"name": "VERSION", "value": version}],
                                     "ports": [{"name": "http", "containerPort": 8080}],
                                     "readinessProbe": {"httpGet": {"path": "/", "port": 8080},
                                                        "periodSeconds": 1}}]}}}}


def service(name: str, target_port: int | str = "http") -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"type": "LoadBalancer", "selector": {"app": name},
                     "ports": [{"port": 8000, "targetPort": target_port}]}}


def get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            return reply.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def address(kube, namespace: str, name: str) -> str | None:
    ingress = (kube.core.read_namespaced_service(name, namespace).status.load_balancer.ingress or [])
    return ingress[0].ip if ingress else None


def test_a_load_balancer_service_gets_a_loopback_address_and_follows_a_rollout(kube, namespace, wait_for):
    kube.apps.create_namespaced_deployment(namespace, deployment("web", 1, "v1"))
    kube.core.create_namespaced_service(namespace, service("web"))
    ip = wait_for(lambda: address(kube, namespace, "web"), timeout=30, what="the Service's address")
    assert str(ip).startswith("127.")
    url = f"http://{ip}:8000/"
    first = wait_for(lambda: get(url), timeout=60, what="the Service to answer from the ready pod")
    assert str(first).endswith(" v1")

    # A rollout: new connections reach the new pod once it is ready, and only it once the old one is gone.
    kube.apps.patch_namespaced_deployment("web", namespace, {"spec": {"template": {"spec": {"containers": [
        {"name": "web", "env": [{"name": "VERSION", "value": "v2"}]}]}}}})
    wait_for(lambda: (get(url) or "").endswith(" v2"), timeout=90, what="traffic on the new pod")
    wait_for(lambda: len(kube.core.list_namespaced_pod(namespace, label_selector="app=web").items) == 1,
             timeout=60, what="the old pod gone")
    answers = {get(url) for _ in range(10)}
    assert len(answers) == 1 and next(iter(answers)).endswith(" v2"), answers
    assert address(kube, namespace, "web") == ip  # the address is stable across rollouts


def test_connections_are_spread_over_every_ready_pod_and_refused_without_one(kube, namespace, wait_for):
    kube.apps.create_namespaced_deployment(namespace, deployment("pair", 2, "v1"))
    kube.core.create_namespaced_service(namespace, service("pair", 8080))
    ip = wait_for(lambda: address(kube, namespace, "pair"), timeout=30, what="the Service's address")
    url = f"http://{ip}:8000/"

    def both() -> bool:
        return len({(get(url) or "").split(" ")[0] for _ in range(6)} - {""}) == 2

    wait_for(both, timeout=90, what="both pods answering through the Service")
    kube.apps.patch_namespaced_deployment_scale("pair", namespace, {"spec": {"replicas": 0}})
    wait_for(lambda: get(url) is None, timeout=60, what="the Service refusing once no pod is ready")
