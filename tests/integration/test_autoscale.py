"""The measured capacity handed to a real autoscaler: `batchtune recommend -o hpa` on the local cluster.

prometheus-adapter v0.12.0 (built from its Go module by hack/localcluster/build) runs on loopback with
the rule the CLI prints, registered as the `custom.metrics.k8s.io` APIService through an ExternalName
Service (the aggregator resolves it to localhost; no pod network is needed). The controller-manager's
own HPA controller then scales the twin-backed production on `vllm_requests_per_second`: up when the
offered load exceeds the measured capacity per replica, back down when the load stops.

The BatchTuning's decision is written into its status by the test (the tuning itself is covered by
test_operator.py): a capacity of 1 request/s per replica, so 3 requests/s need 3 replicas.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request

import pytest
import yaml
from operator_env import Traffic, production

import batchtune_local as lc
from batchtune_local.binaries import prometheus_adapter

pytestmark = [pytest.mark.integration, pytest.mark.slow]
APISERVICE = "v1beta1.custom.metrics.k8s.io"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decided(namespace: str, capacity: float) -> tuple[dict, dict]:
    setting = {"maxNumSeqs": 128, "gpuMemoryUtilizationPercent": 95}
    bt = {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": {"name": "tune", "namespace": namespace},
          "spec": {"targetRef": {"name": "llm"}, "searchSpace": {"maxNumSeqs": {"values": [128]}},
                   "slo": {"interTokenLatencyMilliseconds": 40, "headroomPercent": 10},
                   "prometheus": {"url": "http://127.0.0.1:9090"}, "apply": {"mode": "Recommend"}}}
    status = {"phase": "Recommended", "observedGeneration": 1, "bestTrial": "tune-trial-0",
              "trials": [{"index": 0, "name": "tune-trial-0", "setting": setting, "state": "Done",
                          "metrics": {"sloCapacity": capacity}}],
              "recommendation": {"setting": setting, "reason": "highest SLO capacity", "replicasHint": 2}}
    return bt, status


@pytest.fixture
def adapter_config(tmp_path, cluster, kube, namespace, batchtuning_crd):
    """The HPA the CLI writes, and the adapter rule it prints beside it."""
    bt, status = decided(namespace, 1.0)
    kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", bt)
    kube.custom.patch_namespaced_custom_object_status("batchtune.io", "v1alpha1", namespace, "batchtunings", "tune",
                                                      {"status": status})
    kubeconfig = str(cluster.admin_kubeconfig)
    out = subprocess.run([sys.executable, "-m", "batchtune", "recommend", "tune", "-n", namespace, "-o", "hpa",
                          "--max-replicas", "3", "--scale-down-seconds", "15", "--kubeconfig", kubeconfig],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    comment = [line[2:] for line in out.stdout.splitlines() if line.startswith("# ")]
    rules = yaml.safe_load("\n".join(comment[comment.index("rules:"):]))
    (tmp_path / "adapter.yaml").write_text(yaml.safe_dump(rules))
    return yaml.safe_load(out.stdout), tmp_path / "adapter.yaml"


@pytest.fixture
def adapter(cluster, kubectl, namespace, adapter_config, tmp_path):
    hpa, config = adapter_config
    port = free_port()
    log = open(tmp_path / "adapter.log", "w")  # noqa: SIM115  # its output while it runs
    proc = subprocess.Popen(
        [str(prometheus_adapter()), f"--secure-port={port}", "--bind-address=127.0.0.1",
         f"--cert-dir={tmp_path / 'certs'}", f"--lister-kubeconfig={cluster.admin_kubeconfig}",
         f"--authentication-kubeconfig={cluster.admin_kubeconfig}",
         # The caller (the HPA controller's ServiceAccount) comes in the aggregator's X-Remote-User header,
         # trusted through kube-system/extension-apiserver-authentication; each read is a SubjectAccessReview.
         f"--authorization-kubeconfig={cluster.admin_kubeconfig}",
         f"--prometheus-url={cluster.prometheus_url}", "--metrics-relist-interval=5s", f"--config={config}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE

    def healthy() -> bool:
        try:
            return urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2, context=insecure).status == 200
        except OSError:
            return False

    try:
        lc.wait_for(healthy, timeout=30, what="prometheus-adapter healthy")
        kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "prometheus-adapter", "namespace": namespace},
             "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": port}]}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
             "spec": {"group": "custom.metrics.k8s.io", "version": "v1beta1", "insecureSkipTLSVerify": True,
                      "groupPriorityMinimum": 100, "versionPriority": 100,
                      "service": {"namespace": namespace, "name": "prometheus-adapter", "port": port}}}]))
        yield hpa
    finally:
        kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found", check=False)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        log.close()


def replicas(kube, namespace: str) -> int:
    return kube.apps.read_namespaced_deployment("llm", namespace).spec.replicas or 0


@pytest.mark.timeout(600)  # above its waits: 60 + 30 s for the adapter, 90 s for production, 90 + 150 + 150 s
def test_an_hpa_on_the_measured_capacity_follows_the_load(kube, kubectl, namespace, adapter, wait_for):
    hpa = adapter
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "1000m"
    kube.apps.create_namespaced_deployment(namespace, production(namespace))
    wait_for(lambda: (kube.apps.read_namespaced_deployment("llm", namespace).status.ready_replicas or 0) >= 1,
             timeout=90, what="production ready")
    # The real API server's autoscaling/v2 schema takes the manifest as written (strict: no unknown field).
    kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=yaml.safe_dump(hpa))
    kubectl("apply", "-f", "-", input=yaml.safe_dump(hpa))

    # The pods listed every 2 s, not before each request: at the API server's pace on a loaded machine the rate fell
    # under the 3 a second the HPA must see (CI here, 4 Dec: it stayed below 3 replicas).
    traffic = Traffic(kube, namespace, "app=llm", rate=3, concurrency=8, deadline_s=300, ips_every_s=2)
    traffic.start()
    try:
        def per_pod() -> bool:
            out = kubectl("get", "--raw", f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/"
                                          "vllm_requests_per_second", check=False)
            return out.returncode == 0 and '"value"' in out.stdout
        wait_for(per_pod, timeout=90, interval=2, what="vllm_requests_per_second served by the adapter")
        wait_for(lambda: replicas(kube, namespace) >= 3, timeout=150, interval=2,
                 what="the HPA scaling production to 3 replicas under 3 req/s at 1 req/s per replica")
        assert replicas(kube, namespace) == 3  # maxReplicas
    finally:
        traffic.stop()
    # No load: the rate falls to 0 over the 1 m window, then the 15 s scale-down window passes.
    wait_for(lambda: replicas(kube, namespace) == 1, timeout=150, interval=2, what="the HPA scaling back to 1")
