"""Helpers for operator integration tests: a twin-backed production Deployment, the operator as a
subprocess under its least-privilege identity, steady production traffic, and status polling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

import batchtune_local as lc

REPO = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.1-70B-Instruct"
# 70B fp8 on one H100 streams few tokens per second of wall time, so a 2-core machine keeps up.
PRODUCTION_ARGS = [MODEL, "--quantization", "fp8", "--max-model-len", "4096", "--max-num-seqs", "128",
                   "--gpu-memory-utilization", "0.95", "--port", "8000"]


def production(namespace: str, name: str = "llm", args: list[str] | None = None,
               labels: dict[str, str] | None = None, command: list[str] | None = None) -> dict:
    container: dict[str, Any] = {
        "name": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": list(args or PRODUCTION_ARGS),
        "env": [{"name": "BATCHTUNE_TWIN_LOAD_SECONDS", "value": "2"}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    }
    if command is not None:
        container["command"] = command
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": {
            "replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name},
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8000"}},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 2},
            },
        },
    }


def batchtuning(namespace: str, prometheus_url: str, name: str = "tune", target: str = "llm",
                **overrides: Any) -> dict:
    spec: dict[str, Any] = {
        "targetRef": {"name": target},
        "searchSpace": {"maxNumSeqs": {"values": [8, 16, 32, 64]}, "gpuMemoryUtilizationPercent": [95]},
        "strategy": {"type": "Adaptive", "maxTrials": 4, "maxParallelTrials": 2},
        "objective": {"type": "SloCapacity"},
        "slo": {"percentile": "P95", "interTokenLatencyMilliseconds": 40, "e2eLatencyMilliseconds": 4000,
                "maxErrorRatePercent": 1, "headroomPercent": 10},
        "load": {"inputTokens": 256, "outputTokens": 64},
        "trial": {"warmupSeconds": 3, "measureSeconds": 8, "readinessTimeoutSeconds": 90},
        "prometheus": {"url": prometheus_url},
        "apply": {"verifySeconds": 15, "cooldownSeconds": 0, "verifyMinRequests": 10},
    }
    for key, value in overrides.items():
        spec[key] = value
    return {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def grant_operator_rbac(kubectl: Callable[..., Any]) -> None:
    """The chart's ClusterRole, bound to the cluster's non-admin `batchtune-operator` user."""
    helm = lc.binaries().helm
    rendered = subprocess.run(
        [str(helm), "template", "batchtune-test", str(REPO / "charts" / "batchtune"), "--kube-version", "1.36.3",
         "--show-only", "templates/rbac.yaml"], capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ClusterRole"]
    role = docs[0]
    role["metadata"] = {"name": "batchtune-operator-test"}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "batchtune-operator-test"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": "batchtune-operator-test"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "batchtune-operator"}]}
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))


class Operator:
    """`batchtune operator -n NS` as a subprocess with the operator's own kubeconfig."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.kubeconfig, self.namespace, self.log_dir = kubeconfig, namespace, log_dir
        self.extra_args = extra_args
        """More `batchtune operator` flags (install settings: --allowed-git-url, ...)."""
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        port = _free_port()
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), BATCHTUNE_SCRAPE_LAG_SECONDS="5",
                   BATCHTUNE_SCRAPE_INTERVAL_SECONDS="2")  # the local cluster's Prometheus scrapes every 2 s
        self.starts += 1
        log = open(self.log_dir / f"operator-{self.starts}.log", "w")  # noqa: SIM115  # the operator's stdout while it runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchtune", "operator", "-n", self.namespace, "--tick-seconds", "1",
             "--liveness-address", f"127.0.0.1:{port}", "--metrics-address", "", *self.extra_args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.liveness = f"http://127.0.0.1:{port}/healthz"

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a node dies."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        return "\n".join(p.read_text()[-4000:] for p in sorted(self.log_dir.glob("operator-*.log")))


def running_operator(operator_kubeconfig: str | Path, kube: Any, namespace: str, log_dir: Path,
                     extra_args: tuple[str, ...] = ()) -> Iterator[Operator]:
    """The body of an `operator` fixture: the operator for the test, then its BatchTunings deleted while
    it still runs (so their finalizer is honoured and the namespace can go), then stopped."""
    op = Operator(Path(operator_kubeconfig), namespace, log_dir, extra_args)
    op.start()
    yield op
    op.start() if op.proc is None or op.proc.poll() is not None else None
    kube.custom.delete_collection_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and kube.custom.list_namespaced_custom_object(
            "batchtune.io", "v1alpha1", namespace, "batchtunings")["items"]:
        time.sleep(0.5)
    op.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Traffic(threading.Thread):
    """Steady production traffic: `rate` requests per second, each to the current production pod IP.

    Service routing does not exist on the local cluster, so the pod IP is looked up again on every
    request, which also follows a rollout."""

    def __init__(self, kube: Any, namespace: str, selector: str, rate: float = 2.0, max_tokens: int = 16,
                 concurrency: int = 1, deadline_s: float = 900, prompt_words: int = 200) -> None:
        super().__init__(daemon=True)
        self.kube, self.namespace, self.selector = kube, namespace, selector
        self.rate, self.max_tokens, self.concurrency = rate, max_tokens, concurrency
        self.prompt_words = prompt_words
        """Words per prompt (the twin counts 1.3 tokens a word); set it while running to shift the traffic."""
        self.deadline = time.monotonic() + deadline_s
        self.stopped = threading.Event()
        self.sent = self.failed = 0

    def _ips(self) -> list[str]:
        pods = self.kube.core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
        return [p.status.pod_ip for p in pods if p.status.pod_ip and not p.metadata.deletion_timestamp and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]

    def _one(self, ip: str) -> None:
        body = json.dumps({"model": MODEL, "prompt": "hello " * self.prompt_words,
                           "max_tokens": self.max_tokens}).encode()
        req = urllib.request.Request(f"http://{ip}:8000/v1/completions", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except OSError:
            self.failed += 1

    def run(self) -> None:
        workers: list[threading.Thread] = []
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            ips = self._ips()
            workers = [w for w in workers if w.is_alive()]
            if ips and len(workers) < self.concurrency:
                w = threading.Thread(target=self._one, args=(ips[self.sent % len(ips)],), daemon=True)
                w.start()
                workers.append(w)
                self.sent += 1
            self.stopped.wait(1.0 / self.rate)

    def stop(self) -> None:
        self.stopped.set()


def get_bt(kube: Any, namespace: str, name: str) -> dict:
    return kube.custom.get_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", name)


def condition(bt: dict, type_: str) -> dict:
    return next((c for c in (bt.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def wait_phase(kube: Any, namespace: str, name: str, phases: set[str], timeout: float,
               operator: Operator | None = None) -> dict:
    return wait_status(kube, namespace, name, lambda s: s.get("phase") in phases, timeout, operator,
                       f"in {phases}")


def wait_status(kube: Any, namespace: str, name: str, done: Callable[[dict], bool], timeout: float,
                operator: Operator | None = None, what: str = "done") -> dict:
    """Polls the BatchTuning until `done(status)`; fails with its status and the operator's log."""
    deadline = time.monotonic() + timeout
    bt: dict = {}
    while time.monotonic() < deadline:
        bt = get_bt(kube, namespace, name)
        if done(bt.get("status") or {}):
            return bt
        time.sleep(1)
    status = json.dumps(bt.get("status"), indent=1)[-3000:]
    logs = operator.logs()[-3000:] if operator else ""
    raise AssertionError(f"{namespace}/{name} not {what} after {timeout}s; status: {status}\n{logs}")


def container_of(kube: Any, namespace: str, name: str) -> dict:
    dep = kube.apps.read_namespaced_deployment(name, namespace)
    data = kube.api.sanitize_for_serialization(dep)
    return data["spec"]["template"]["spec"]["containers"][0]
