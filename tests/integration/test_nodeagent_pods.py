"""The node agent on a real control plane: pods as local processes, status, scheduling, deletion, metrics.

Most tests run on a private pool: a second node agent this module starts, with tainted nodes and a
test image mapping (`batchtune.test/*` runs the container command as is), so they neither see nor
disturb the cluster's own nodes. The metrics test uses the cluster's agent, which Prometheus scrapes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import batchtune_local as lc

# One lane runs the module: its tests share one extra node agent (`pool`).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("nodeagent-pool")]

POOL_LABEL = "batchtune.io/nodeagent-test"
POOL_NETWORK = lc.lanes.scratch_network()
SERVER = (
    "import http.server, os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = (os.environ['HOSTNAME'] + ' ' + os.environ['NVIDIA_VISIBLE_DEVICES']).encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer((os.environ['BATCHTUNE_POD_IP'], 8080), H).serve_forever()\n"
)


@dataclass
class Pool:
    id: str
    nodes: tuple[str, ...]
    state_dir: Path
    log: Path
    argv: list[str]
    agent: subprocess.Popen[bytes] | None = None

    def start(self, kube) -> None:
        with open(self.log, "ab") as out:
            self.agent = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready(kube):
            if self.agent.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pool node agent did not get ready:\n{self.log_tail()}", pytrace=False)
            time.sleep(0.5)

    def _ready(self, kube) -> bool:
        try:
            return all(any(c.type == "Ready" and c.status == "True" for c in kube.core.read_node(n).status.conditions or [])
                       for n in self.nodes)
        except Exception:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.agent is None:
            return
        self.agent.send_signal(sig)
        try:
            self.agent.wait(40)
        except subprocess.TimeoutExpired:
            self.agent.kill()
            self.agent.wait(5)
        self.agent = None

    def pod_spec(self, command: list[str], *, gpus: int = 1, restart: str = "Always", image: str = "batchtune.test/cmd",
                 **container: Any) -> dict[str, Any]:
        main: dict[str, Any] = {"name": "main", "image": image, "command": command, **container}
        if gpus:
            main["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
        return {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {POOL_LABEL: self.id},
            "tolerations": [{"key": POOL_LABEL, "operator": "Equal", "value": self.id, "effect": "NoSchedule"}],
            "containers": [main],
        }

    def pids(self) -> dict[str, int]:
        """{pod name: pid} of every process the pool's agent has recorded."""
        state = json.loads((self.state_dir / "state.json").read_text())
        return {r["name"]: p["pid"] for r in state["pods"].values() for p in r["processes"].values()}

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture(scope="module")
def pool(cluster, kube, tmp_path_factory) -> Iterator[Pool]:
    pool_id = secrets.token_hex(3)
    root = tmp_path_factory.mktemp("nodeagent-pool")
    image_map = root / "images.yaml"
    image_map.write_text('images:\n  - match: "batchtune.test/*"\n    run: []\n')
    log = root / "agent.log"
    prefix = f"na-{pool_id}-"
    argv = [
        sys.executable, "-m", "batchtune_local.nodeagent", "--kubeconfig", str(cluster.admin_kubeconfig),
        "--nodes", "2", "--gpus-per-node", "8", "--node-prefix", prefix, "--state-dir", str(root / "state"),
        "--node-label", f"{POOL_LABEL}={pool_id}", "--node-taint", f"{POOL_LABEL}={pool_id}:NoSchedule",
        "--image-map", str(image_map), "--metrics-address", f"127.0.0.1:{_free_port()}",
        "--pod-network", POOL_NETWORK, "--time-scale", "20",
    ]
    pool = Pool(pool_id, (f"{prefix}0", f"{prefix}1"), root / "state", log, argv)
    try:
        pool.start(kube)
        yield pool
    finally:
        pool.stop()
        for name in pool.nodes:
            with contextlib.suppress(Exception):  # best effort: the node may be gone already
                kube.core.delete_node(name)


def _pods(kube, namespace: str, selector: str) -> list[Any]:
    return kube.core.list_namespaced_pod(namespace, label_selector=selector).items


def _deployment(name: str, replicas: int, pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec}},
    }


def _container_state(pod) -> Any:
    statuses = pod.status.container_statuses or []
    return statuses[0] if statuses else None


def test_deployment_pod_runs_ready_answers_on_its_ip_and_deletion_ends_it(pool, kube, namespace, wait_for):
    spec = pool.pod_spec(["python3", "-c", SERVER],
                         readinessProbe={"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1})
    kube.apps.create_namespaced_deployment(namespace, _deployment("web", 1, spec))

    def ready_pod():
        for pod in _pods(kube, namespace, "app=web"):
            if pod.status.phase == "Running" and any(
                    c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []):
                return pod
        return None

    pod = wait_for(ready_pod, timeout=60, what="a Running, Ready pod of Deployment web")
    ip = pod.status.pod_ip
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(POOL_NETWORK) and pod.status.host_ip == "127.0.0.1"
    assert pod.spec.node_name in pool.nodes
    body = urllib.request.urlopen(f"http://{ip}:8080/", timeout=5).read().decode()
    assert body.split()[0] == pod.metadata.name and body.split()[1].isdigit()
    pid = pool.pids()[pod.metadata.name]
    assert _alive(pid)
    wait_for(lambda: kube.apps.read_namespaced_deployment(namespace=namespace, name="web").status.available_replicas == 1,
             timeout=30, what="Deployment web available")

    kube.apps.delete_namespaced_deployment("web", namespace, propagation_policy="Foreground")
    wait_for(lambda: not _pods(kube, namespace, "app=web"), timeout=60, what="pods of web removed")
    assert not _alive(pid), f"process {pid} of {pod.metadata.name} still runs"
    assert pod.metadata.name not in pool.pids()


def test_17_pods_on_16_gpus_leave_exactly_one_unschedulable(pool, kube, namespace, wait_for):
    kube.apps.create_namespaced_deployment(namespace, _deployment("fill", 17, pool.pod_spec(["sleep", "3600"])))

    def settled():
        pods = _pods(kube, namespace, "app=fill")
        running = [p for p in pods if p.status.phase == "Running"]
        pending = [p for p in pods if p.status.phase == "Pending"]
        return (running, pending) if len(pods) == 17 and len(running) == 16 else None

    running, pending = wait_for(settled, timeout=90, what="16 of 17 pods Running")
    assert len(pending) == 1
    scheduled = {c.type: c for c in pending[0].status.conditions or []}["PodScheduled"]
    assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
    assert "nvidia.com/gpu" in scheduled.message
    devices = {(p.spec.node_name, p.metadata.name) for p in running}
    assert {node for node, _ in devices} == set(pool.nodes)
    pids = [pool.pids()[p.metadata.name] for p in running]
    assert len(set(pids)) == 16 and all(_alive(pid) for pid in pids)

    kube.apps.delete_namespaced_deployment("fill", namespace, propagation_policy="Foreground")
    wait_for(lambda: not _pods(kube, namespace, "app=fill"), timeout=90, what="pods of fill removed")
    assert not [pid for pid in pids if _alive(pid)]


def _bare_pod(kube, namespace: str, name: str, spec: dict[str, Any]) -> None:
    kube.core.create_namespaced_pod(namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                                                "spec": spec})


def test_exit_137_shows_oomkilled(pool, kube, namespace, wait_for):
    _bare_pod(kube, namespace, "oom", pool.pod_spec(["sh", "-c", "exit 137"], restart="Never"))

    def terminated():
        pod = kube.core.read_namespaced_pod("oom", namespace)
        state = _container_state(pod)
        return (pod, state.state.terminated) if state and state.state.terminated else None

    pod, term = wait_for(terminated, timeout=60, what="container of pod oom terminated")
    assert (term.exit_code, term.reason) == (137, "OOMKilled")
    assert pod.status.phase == "Failed"


def test_crashing_container_shows_crashloopbackoff(pool, kube, namespace, wait_for):
    _bare_pod(kube, namespace, "crash", pool.pod_spec(["sh", "-c", "echo dying; exit 3"], gpus=0))

    def backing_off():
        state = _container_state(kube.core.read_namespaced_pod("crash", namespace))
        waiting = state.state.waiting if state else None
        return state if waiting and waiting.reason == "CrashLoopBackOff" else None

    state = wait_for(backing_off, timeout=60, what="pod crash in CrashLoopBackOff")
    assert state.restart_count >= 1
    assert (state.last_state.terminated.exit_code, state.last_state.terminated.reason) == (3, "Error")
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=crash").items
    assert {"Started", "BackOff"} <= {e.reason for e in events}


def test_job_pod_completes_with_its_termination_message(pool, kube, namespace, wait_for):
    spec = pool.pod_spec(["sh", "-c", 'echo "best max-num-seqs: 64" > "$BATCHTUNE_TERMINATION_MESSAGE_PATH"'],
                         restart="Never")
    kube.batch.create_namespaced_job(namespace, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "once"},
        "spec": {"backoffLimit": 0, "template": {"spec": spec}},
    })
    wait_for(lambda: (kube.batch.read_namespaced_job("once", namespace).status.succeeded or 0) == 1,
             timeout=60, what="Job once succeeded")
    pod, = _pods(kube, namespace, "job-name=once")
    assert pod.status.phase == "Succeeded"
    term = _container_state(pod).state.terminated
    assert (term.reason, term.exit_code, term.message) == ("Completed", 0, "best max-num-seqs: 64\n")


def test_unmapped_image_waits_with_errimagepull(pool, kube, namespace, wait_for):
    spec = pool.pod_spec(["x"], gpus=0, image="docker.io/library/nginx:1.27")

    def waiting():
        state = _container_state(kube.core.read_namespaced_pod("nginx", namespace))
        return state.state.waiting if state and state.state.waiting and state.state.waiting.reason != "ContainerCreating" else None

    _bare_pod(kube, namespace, "nginx", spec)
    state = wait_for(waiting, timeout=30, what="pod nginx waiting")
    assert state.reason == "ErrImagePull"
    assert "docker.io/library/nginx:1.27" in state.message and "images.yaml" in state.message


def test_gpu_metric_is_labelled_with_the_pod_holding_the_gpu(cluster, kube, namespace, prometheus_url, wait_for):
    # The cluster's own agent (scraped by Prometheus) runs the vLLM image as the twin server.
    kube.apps.create_namespaced_deployment(namespace, _deployment("vllm", 1, {
        "terminationGracePeriodSeconds": 5,
        "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                        "args": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "64"],
                        "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
    }))
    pod = wait_for(lambda: next((p for p in _pods(kube, namespace, "app=vllm") if p.status.phase == "Running"), None),
                   timeout=60, what="vllm pod Running")
    query = f'DCGM_FI_DEV_FB_USED{{namespace="{namespace}",pod="{pod.metadata.name}"}}'

    def series():
        url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        result = json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]
        return result if result and float(result[0]["value"][1]) > 0 else None

    result = wait_for(series, timeout=120, interval=1, what=f"Prometheus series {query} > 0")
    labels = result[0]["metric"]
    assert labels["container"] == "vllm" and labels["Hostname"] == pod.spec.node_name
    assert labels["modelName"].startswith("NVIDIA") and labels["device"] == f"nvidia{labels['gpu']}"
    kube.apps.delete_namespaced_deployment("vllm", namespace)


def test_restarted_agent_adopts_running_processes_and_kills_orphans(pool, kube, namespace, wait_for):
    for name in ("keep", "orphan"):
        _bare_pod(kube, namespace, name, pool.pod_spec(["sleep", "3600"], gpus=0))
    for name in ("keep", "orphan"):
        wait_for(lambda n=name: kube.core.read_namespaced_pod(n, namespace).status.phase == "Running",
                 timeout=60, what=f"pod {name} Running")
    before = kube.core.read_namespaced_pod("keep", namespace)
    pids = pool.pids()
    keep_pid, orphan_pid = pids["keep"], pids["orphan"]

    pool.stop(signal.SIGKILL)  # a crash: nothing is cleaned up
    assert _alive(keep_pid) and _alive(orphan_pid)
    kube.core.delete_namespaced_pod("orphan", namespace, grace_period_seconds=0)  # gone while the agent is down
    pool.start(kube)

    wait_for(lambda: not _alive(orphan_pid), timeout=30, what=f"orphan process {orphan_pid} killed")
    assert _alive(keep_pid) and pool.pids()["keep"] == keep_pid
    time.sleep(2)  # a few sync rounds of the new agent
    after = kube.core.read_namespaced_pod("keep", namespace)
    assert after.status.pod_ip == before.status.pod_ip
    assert after.status.phase == "Running" and _container_state(after).restart_count == 0
    kube.core.delete_namespaced_pod("keep", namespace)
    wait_for(lambda: not _alive(keep_pid), timeout=30, what=f"process {keep_pid} of pod keep ended")


def test_kubectl_logs_reads_the_process_output(pool, kube, namespace, kubectl, wait_for):
    _bare_pod(kube, namespace, "talker", pool.pod_spec(
        ["sh", "-c", "echo first line; echo second line; sleep 3600"], gpus=0))
    wait_for(lambda: kube.core.read_namespaced_pod("talker", namespace).status.phase == "Running",
             timeout=60, what="pod talker Running")
    out = wait_for(lambda: kubectl("logs", "-n", namespace, "talker", "--tail=1", check=False).stdout.strip(),
                   timeout=20, what="kubectl logs talker")
    assert out == "second line"
