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


SLO = {"percentile": "P95", "interTokenLatencyMilliseconds": 100, "e2eLatencyMilliseconds": 4000,
                 "maxErrorRatePercent": 1, "headroomPercent": 10}
"""The tunings' SLO. The inter-token bound is far above the twin's (p95 26-28 ms predicted at every load these tests
run below 64 streams, 28-33 ms measured on a quiet machine), because a busy 2-core machine's scheduling stretched
the measured p95 to 36-46 ms at the same load (make test, lanes beside the real-vLLM tier), past the 36 ms bound a
40 ms target gave: the tests assert mechanisms and choices, which the end-to-end bound decides as before (the
capacities `predicted_best` gives are the same for 40 and 100 ms)."""


LENIENT_SLO = {"percentile": "P95", "e2eLatencyMilliseconds": 60000, "maxErrorRatePercent": 1}
"""For tests that assert something other than the SLO (an owner, no decision while Prometheus is down): a target no
starved client misses (CI of 4 Dec read p95 ITL of 91-142 ms at the client under load, against the shared SLO's 90)."""


def batchtuning(namespace: str, prometheus_url: str, name: str = "tune", target: str = "llm",
                **overrides: Any) -> dict:
    spec: dict[str, Any] = {
        "targetRef": {"name": target},
        "searchSpace": {"maxNumSeqs": {"values": [8, 16, 32, 64]}, "gpuMemoryUtilizationPercent": [95]},
        "strategy": {"type": "Adaptive", "maxTrials": 4, "maxParallelTrials": 2},
        "objective": {"type": "SloCapacity"},
        "slo": dict(SLO),
        "load": {"inputTokens": 256, "outputTokens": 64},
        "trial": {"warmupSeconds": 3, "measureSeconds": 8, "readinessTimeoutSeconds": 90},
        "prometheus": {"url": prometheus_url},
        # Auto by name: an unset mode is Recommend, and these tunings are meant to change production.
        "apply": {"mode": "Auto", "verifySeconds": 15, "cooldownSeconds": 0, "verifyMinRequests": 10},
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
    """`batchtune operator -n NS` as a subprocess with the operator's own kubeconfig.

    `leader_elect`: one of several replicas (`--leader-elect`, the Lease in NS; its /metrics served, so a test can
    tell the leader by `batchtune_leader`). `env`: extra environment for the next start only (e.g. failpoints).
    `scrape_interval`: the override the operator gets (None: it reads the interval from Prometheus).
    `extra_args`: more `batchtune operator` flags (install settings: --allowed-git-url, ...)."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path, extra_args: tuple[str, ...] = (), *,
                 leader_elect: bool = False, name: str = "operator", scrape_interval: str | None = "2") -> None:
        self.kubeconfig, self.namespace, self.log_dir = kubeconfig, namespace, log_dir
        self.leader_elect, self.name, self.scrape_interval = leader_elect, name, scrape_interval
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.metrics_url: str | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        port = _free_port()
        environ = dict(os.environ, KUBECONFIG=str(self.kubeconfig), BATCHTUNE_SCRAPE_LAG_SECONDS="5", **(env or {}))
        if self.scrape_interval:
            environ["BATCHTUNE_SCRAPE_INTERVAL_SECONDS"] = self.scrape_interval  # the local cluster scrapes every 2 s
        else:
            environ.pop("BATCHTUNE_SCRAPE_INTERVAL_SECONDS", None)
        self.starts += 1
        log = open(self.log_dir / f"{self.name}-{self.starts}.log", "w")  # noqa: SIM115  # the operator's stdout while it runs
        metrics = ""
        extra: list[str] = []
        if self.leader_elect:
            metrics_port = _free_port()
            metrics = f"127.0.0.1:{metrics_port}"
            self.metrics_url = f"http://{metrics}/metrics"
            extra = ["--leader-elect", "--leader-elect-namespace", self.namespace]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchtune", "operator", "-n", self.namespace, "--tick-seconds", "1",
             "--liveness-address", f"127.0.0.1:{port}", "--metrics-address", metrics, *extra,
             # The local cluster's Prometheus is on loopback, which an install allows only by naming it.
             "--allowed-prometheus-url=http://127.0.0.1", *self.extra_args],
            env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.liveness = f"http://127.0.0.1:{port}/healthz"

    def metric(self, name: str) -> float | None:
        """One unlabelled sample of this replica's /metrics (None: not serving, or no such sample)."""
        if not self.metrics_url or self.proc is None or self.proc.poll() is not None:
            return None
        try:
            text = urllib.request.urlopen(self.metrics_url, timeout=2).read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a node dies."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: the replica holds its place but does nothing until killed (or SIGCONT)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        return "\n".join(p.read_text()[-4000:] for p in sorted(self.log_dir.glob(f"{self.name}-*.log")))

    def standing_by(self) -> bool:
        """This start of the replica has read the Lease and waits on another holder (`controller.leader`'s log)."""
        log = self.log_dir / f"{self.name}-{self.starts}.log"
        return self.alive() and log.exists() and "Standing by: the Lease" in log.read_text()


def running_operator(operator_kubeconfig: str | Path, kube: Any, namespace: str, log_dir: Path,
                     extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[Operator]:
    """The body of an `operator` fixture: the operator for the test, then its BatchTunings deleted while
    it still runs (so their finalizer is honoured and the namespace can go), then stopped. `env`: extra
    environment for every start (install settings the chart passes as variables, e.g. BATCHTUNE_WORKERS)."""
    op = Operator(Path(operator_kubeconfig), namespace, log_dir, extra_args)
    op.start(env)
    yield op
    op.start(env) if op.proc is None or op.proc.poll() is not None else None
    kube.custom.delete_collection_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and kube.custom.list_namespaced_custom_object(
            "batchtune.io", "v1alpha1", namespace, "batchtunings")["items"]:
        time.sleep(0.5)
    op.stop()


def grant_lease_rbac(kube: Any, namespace: str) -> None:
    """The chart's leader-election Role (leases in the release namespace) for `batchtune-operator` in `namespace`."""
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "batchtune-leader", "namespace": namespace},
            "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
                      {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "resourceNames": ["batchtune-operator"], "verbs": ["get", "update"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "batchtune-leader", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "batchtune-leader"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "batchtune-operator"}]}
    kube.rbac.create_namespaced_role(namespace, role)
    kube.rbac.create_namespaced_role_binding(namespace, binding)


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
                 concurrency: int = 1, deadline_s: float = 900, prompt_words: int = 200,
                 ips_every_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.kube, self.namespace, self.selector = kube, namespace, selector
        self.ips_every_s = ips_every_s
        """How often the pod IPs are listed again (0: before every request). A flood lists less often, so that its
        rate does not fall to the API server's pace on a loaded machine."""
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
        ips: list[str] = []
        listed = float("-inf")
        while not self.stopped.is_set() and time.monotonic() < self.deadline:
            if not ips or time.monotonic() - listed >= self.ips_every_s:
                ips, listed = self._ips(), time.monotonic()
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
