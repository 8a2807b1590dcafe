"""An in-memory world for reconcile tests: a cluster, a Prometheus and a simulated engine behind the ports.

The reconcile loop sees exactly the `controller.ports` interfaces. This world keeps Deployments, pods,
Jobs and nodes in dicts, answers Prometheus from a model of how a setting behaves under load, and
records every write, so a test can step the clock, change the world and read what the loop did.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from batchtune.controller.ports import Conflict, Install, JobRun, NotAllowed, Owned, Ports
from batchtune.controller.reconcile import on_delete, reconcile
from batchtune.controller.tick import PROMETHEUS_BACKOFF, Tuning
from batchtune.core.manifests import LABEL_COMPONENT, LABEL_TRIAL, LABEL_TUNING, label_value
from batchtune.core.measurement import Window
from batchtune.core.pods import load_run_outcome
from batchtune.core.scrape import ScrapeInterval
from batchtune.core.vocabulary import M
from batchtune.core.workload import WorkloadObservation
from batchtune.engines import ENGINES
from batchtune.prometheus import Production, PrometheusUnavailable

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
LOCAL_PROMETHEUS = ("http://127.0.0.1:9090/",)
"""The specs' Prometheus, on loopback: an install allows loopback only by naming it (core.policy)."""
NS = "inference"

# (maxNumSeqs, gpuMemoryUtilizationPercent, concurrency) -> p95 figures the engine would give.
Model = Callable[[int, int, int], dict[str, float]]


def knee_model(seqs: int, gmu: int, concurrency: int) -> dict[str, float]:
    """Throughput grows with the batch up to a knee at 32; latency grows with the running batch and the queue."""
    running = min(seqs, concurrency)
    throughput = 40.0 * min(running, 32) ** 0.8
    queue = max(0, concurrency - seqs)
    itl = 10.0 + 0.6 * running
    ttft = 80.0 + 40.0 * queue
    return {M.ITL_MS: itl, M.TTFT_MS: ttft, M.E2E_MS: ttft + 128 * itl, M.OUTPUT_THROUGHPUT: throughput * 10,
            M.REQUEST_THROUGHPUT: throughput / 12.8, M.WAITING_REQUESTS: float(queue),
            M.KV_CACHE_USAGE_PERCENT: min(100.0, running * 2.0), M.GPU_UTIL_PERCENT: 95.0, M.POWER_WATTS: 500.0}


LENGTH_BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, math.inf)


def buckets(per_bucket: Mapping[float, float]) -> tuple[tuple[float, float], ...]:
    """Cumulative `le` buckets (vLLM's 1-2-5 bounds) from per-bucket counts."""
    running, out = 0.0, []
    for bound in LENGTH_BOUNDS:
        running += per_bucket.get(bound, 0.0)
        out.append((bound, running))
    return tuple(out)


def chat_traffic(requests_per_window: float = 300.0, windows: int = 60) -> WorkloadObservation:
    """Short chat: prompts of a few hundred tokens (mean 300), outputs about 100, 5 requests/s."""
    total = requests_per_window * windows
    return WorkloadObservation(3600, buckets({200.0: total * 0.4, 500.0: total * 0.6}),
                               buckets({50.0: total * 0.3, 100.0: total * 0.3, 200.0: total * 0.4}), 300.0, 100.0,
                               tuple([requests_per_window] * windows), 60)


def long_prompt_traffic(requests_per_window: float = 120.0, windows: int = 60) -> WorkloadObservation:
    """Long documents: prompts of 1000-5000 tokens (mean 2500), short outputs, 2 requests/s."""
    total = requests_per_window * windows
    return WorkloadObservation(3600, buckets({2000.0: total * 0.5, 5000.0: total * 0.5}),
                               buckets({50.0: total * 0.5, 100.0: total * 0.5}), 2500.0, 60.0,
                               tuple([requests_per_window] * windows), 60)


def production_target(name: str = "llm", args: list[str] | None = None, gpus: int = 1,
                      labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    labels = dict(labels or {"app": name})
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "1", "generation": 1, "annotations": {},
                     "labels": dict(labels)},
        "spec": {"replicas": 1, "selector": {"matchLabels": dict(labels)},
                 "template": {"metadata": {"labels": dict(labels)}, "spec": {"containers": [{
                     "name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                     "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"],
                     "args": list(args if args is not None else ["--max-num-seqs", "16", "--port", "8000"]),
                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}},
        "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1},
    }


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "targetRef": {"name": "llm"},
        "searchSpace": {"maxNumSeqs": {"values": [8, 16, 32, 64]}},
        "strategy": {"type": "Grid", "maxTrials": 4},
        "slo": {"interTokenLatencyMilliseconds": 60, "ttftMilliseconds": 2000, "headroomPercent": 10},
        "load": {"concurrency": 32},
        "trial": {"warmupSeconds": 10, "measureSeconds": 30, "readinessTimeoutSeconds": 300},
        "prometheus": {"url": "http://127.0.0.1:9090"},
        "apply": {"mode": "Auto", "verifySeconds": 60, "cooldownSeconds": 0, "verifyMinRequests": 20,
                  "verifyTimeoutSeconds": 600},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def _apply_strategic(container: dict[str, Any], change: Mapping[str, Any]) -> None:
    for key in ("command", "args"):
        if key in change:
            if change[key] is None:
                container.pop(key, None)
            else:
                container[key] = list(change[key])


@dataclass
class World:
    """The cluster, Prometheus and the engine, in memory."""

    model: Model = knee_model
    now: datetime = T0
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    replica_sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """ReplicaSets by name: {"uid", "controller"} (the uid of the Deployment that controls it)."""
    nodes: list[dict[str, Any]] | None = field(default_factory=lambda: [{
        "metadata": {"name": "gpu-node-0", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        "status": {"allocatable": {"nvidia.com/gpu": "8"}}}])
    services: list[dict[str, Any]] = field(default_factory=list)
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    patches: list[dict[str, Any]] = field(default_factory=list)
    prometheus_up: bool = True
    queries: int = 0
    auto_ready: bool = True
    """Trial pods become ready as soon as their Deployment exists."""
    trial_failure: Callable[[int, int], str | None] = lambda seqs, gmu: None
    """A termination message for settings that crash at startup (None: they start)."""
    trial_log: Callable[[int, int], str | None] = lambda seqs, gmu: None
    """The engine container's log for a crashed setting (None: the log cannot be read)."""
    logs_read: list[tuple[str, bool]] = field(default_factory=list)
    gpu_model: str | None = None
    """dcgm-exporter's modelName on production's GPU series (None: no such series)."""
    requests_per_second: float | None = None
    """Requests a load run finishes per measured second (None: always 200, enough for any percentile)."""
    requests_per_second_per_load: float | None = None
    """Requests a load run finishes per measured second and unit of load: a higher load finishes more (None:
    `requests_per_second`)."""
    load_runs: list[tuple[str, int]] = field(default_factory=list)
    """(Job name, measured seconds) of every load run, in order."""
    run_loads: list[tuple[int, int, int]] = field(default_factory=list)
    """(trial index, load, measured seconds) of every load run, in order."""
    production_figures: Callable[[dict[str, Any], datetime, datetime], dict[str, float | None]] | None = None
    production_requests_per_second: float = 5.0
    production_replicas: int = 1
    production_peak_per_second: float | None = 10.0
    scrape_lookups: int = 0
    scrape_interval: ScrapeInterval | None = ScrapeInterval(15.0, "Prometheus' targets API: job kubernetes-pods")
    """What the fake Prometheus reports for the target's pods (None: it reports nothing)."""
    """What `production_peak_rate` answers (the highest 1-minute rate of the last hour; None: Prometheus has none)."""
    traffic: WorkloadObservation | None = field(default_factory=lambda: chat_traffic())
    """What production's length histograms and request counts say (None: production has no pods)."""
    failing_loads: set[int] = field(default_factory=set)
    """Load-generator Jobs at these loads (concurrency, or requests per minute) fail."""
    intents: list[int] = field(default_factory=list)
    conflict_next_patch: bool = False
    rollout_done: bool = True
    uid: str = "uid-1"
    generation: int = 1
    status: dict[str, Any] = field(default_factory=dict)
    bt_spec: dict[str, Any] = field(default_factory=spec)
    name: str = "tune"
    _rv: int = 100
    tuning_version: str = "1"
    """The BatchTuning's resourceVersion: a new one with every status write (`apply`)."""
    tuning_reads: int = 0
    """Reads of the BatchTuning from the API server (`FakeCluster.batchtuning`), not the watch's copy."""
    tuning_read_fails: bool = False
    job_controller_lag: bool = False
    """Load pods end (their termination message written) but the Job controller has not marked their Job Complete or
    Failed yet (`complete_jobs` does it): as on a loaded control plane, where that comes seconds after the pod."""

    # ---- the loop -------------------------------------------------------------------------

    def ports(self, install: Install | None = None) -> Ports:
        return Ports(FakeCluster(self), FakeMetrics(self), FakeReports(self),
                     install or Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS,
                                        scrape_lag_seconds=0), ENGINES)

    def tuning(self) -> Tuning:
        return Tuning(self.name, NS, self.uid, self.generation, copy.deepcopy(self.bt_spec), copy.deepcopy(self.status))

    def tick(self, install: Install | None = None, advance: float = 5.0, settle: bool = True) -> dict[str, Any]:
        """One reconcile at `now`, its patch applied to the status; then the clock and the world move on."""
        patch = reconcile(self.tuning(), self.ports(install), self.now, logging.getLogger("test"))
        self.apply(patch)
        self.now += timedelta(seconds=advance)
        if settle:
            self.settle()
        return patch

    def body(self) -> dict[str, Any]:
        """The BatchTuning as the API server holds it (and as kopf hands it to the timer once its watch has it)."""
        return {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
                "metadata": {"name": self.name, "namespace": NS, "uid": self.uid, "generation": self.generation,
                             "resourceVersion": self.tuning_version},
                "spec": copy.deepcopy(self.bt_spec), "status": copy.deepcopy(self.status)}

    def apply(self, patch: Mapping[str, Any]) -> None:
        if patch:
            self.tuning_version = str(int(self.tuning_version) + 1)
        for key, value in patch.items():
            if value is None:
                self.status.pop(key, None)
            else:
                self.status[key] = copy.deepcopy(value)

    def run_until(self, phases: set[str], limit: int = 400, install: Install | None = None) -> str:
        for _ in range(limit):
            if self.status.get("phase") in phases:
                return str(self.status["phase"])
            self.tick(install)
        raise AssertionError(f"phase {self.status.get('phase')} after {limit} ticks, wanted {phases}")

    def delete(self) -> None:
        on_delete(self.tuning(), self.ports(), self.now, logging.getLogger("test"))

    @property
    def phase(self) -> str | None:
        return self.status.get("phase")

    def condition(self, type_: str) -> dict[str, Any]:
        return next((c for c in self.status.get("conditions") or [] if c["type"] == type_), {})

    # ---- the world moving on its own ----------------------------------------------------------

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def settle(self) -> None:
        """Trial pods come up (or crash), load Jobs run to completion, deleted objects go."""
        for name, dep in self.deployments.items():
            labels = dep["metadata"].get("labels") or {}
            if labels.get(LABEL_COMPONENT) != "trial" or not self.auto_ready:
                continue
            pod_name = f"{name}-pod"
            if pod_name in self.pods:
                continue
            container = dep["spec"]["template"]["spec"]["containers"][0]
            seqs, gmu = _knobs(container)
            failure = self.trial_failure(seqs, gmu)
            ready = failure is None
            status: dict[str, Any] = {"phase": "Running", "podIP": f"127.0.0.{len(self.pods) + 10}",
                                      "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
            if failure is not None:
                status["containerStatuses"] = [{"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                                "lastState": {"terminated": {"exitCode": 1, "message": failure}}}]
            replica_set = f"{name}-rs"
            self.replica_sets[replica_set] = {"uid": f"uid-rs-{name}", "controller": dep["metadata"]["uid"]}
            self.pods[pod_name] = {
                "metadata": {"name": pod_name, "namespace": NS, "labels": dict(dep["spec"]["template"]["metadata"]["labels"]),
                             "creationTimestamp": self.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                             "ownerReferences": [controller_ref("ReplicaSet", replica_set, f"uid-rs-{name}")]},
                "spec": {"nodeName": "gpu-node-0", "containers": [container]},
                "status": status,
            }
        self.run_load_jobs()

    def run_load_jobs(self) -> None:
        """Every load Job not run yet runs: its pod ends with the load generator's summary, and the Job controller
        marks it Complete (or Failed), unless `job_controller_lag`."""
        for job in self.jobs.values():
            status = job.setdefault("status", {})
            if status.get("conditions") or f"{job['metadata']['name']}-pod" in self.pods:
                continue
            args = job["spec"]["template"]["spec"]["containers"][0]["args"]
            if "--concurrency" in args:
                load = int(args[args.index("--concurrency") + 1])
            elif "--trace-speed-percent" in args:
                load = int(args[args.index("--trace-speed-percent") + 1]) // 4  # a trace of 4 concurrent at 100%
            else:
                load = int(round(float(args[args.index("--request-rate") + 1]) * 60))
            start = self.now - timedelta(seconds=60)
            end = self.now - timedelta(seconds=1)
            status["startTime"] = start.strftime("%Y-%m-%dT%H:%M:%SZ")
            if load in self.failing_loads:
                job["outcome"] = {"failed": 1, "conditions": [{"type": "Failed", "status": "True"}]}
                self.load_pod(job, "load generator: connection refused", end, exit_code=1)
                if not self.job_controller_lag:
                    status.update(job["outcome"])
                continue
            job["outcome"] = {"completionTime": end.strftime("%Y-%m-%dT%H:%M:%SZ"), "succeeded": 1,
                              "conditions": [{"type": "Complete", "status": "True"}]}
            if not self.job_controller_lag:
                status.update(job["outcome"])
            job["load"] = load
            trial = job["metadata"]["labels"][LABEL_TRIAL]
            dep = self.deployments.get(f"{self.name}-trial-{trial}")
            seqs, gmu = _knobs(dep["spec"]["template"]["spec"]["containers"][0]) if dep else (1, 90)
            figures = self.model(seqs, gmu, load)
            measured = int(args[args.index("--duration") + 1]) - int(args[args.index("--warmup-seconds") + 1]) \
                if "--duration" in args else 60
            self.load_runs.append((job["metadata"]["name"], measured))
            self.run_loads.append((int(trial), load, measured))
            if self.requests_per_second_per_load is not None:
                done = int(self.requests_per_second_per_load * load * measured)
            else:
                done = 200 if self.requests_per_second is None else int(self.requests_per_second * measured)
            summary = {"completed": done, "failed": 0, "samples": done,
                       "measure_start": (start + timedelta(seconds=10)).timestamp(), "measure_end": end.timestamp(),
                       "p95_itl_ms": figures[M.ITL_MS], "p95_ttft_ms": figures[M.TTFT_MS],
                       "p95_e2el_ms": figures[M.E2E_MS], "request_throughput": figures[M.REQUEST_THROUGHPUT],
                       "output_throughput": figures[M.OUTPUT_THROUGHPUT]}
            if M.GOODPUT in figures and "--goodput" in args:
                summary["request_goodput"] = figures[M.GOODPUT]
            self.load_pod(job, json.dumps(summary), end)
            job["figures"] = figures

    def complete_jobs(self) -> None:
        """The Job controller catches up: every Job whose pod has ended is marked Complete (or Failed)."""
        for job in self.jobs.values():
            status = job.setdefault("status", {})
            if job.get("outcome") and not status.get("conditions"):
                status.update(job["outcome"])

    def load_pod(self, job: Mapping[str, Any], message: str, end: datetime, exit_code: int = 0) -> None:
        """The Job's pod, ended with the load generator's termination message."""
        name = job["metadata"]["name"]
        self.pods[f"{name}-pod"] = {
            "metadata": {"name": f"{name}-pod", "namespace": NS,
                         "labels": {LABEL_COMPONENT: "load", "batch.kubernetes.io/job-name": name},
                         "creationTimestamp": self.now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                         "ownerReferences": [controller_ref("Job", name, job["metadata"]["uid"])]},
            "spec": {"containers": [{"name": "loadgen", "resources": {}}]},
            "status": {"phase": "Failed" if exit_code else "Succeeded", "containerStatuses": [
                {"name": "loadgen", "state": {"terminated": {"exitCode": exit_code, "message": message,
                                                             "finishedAt": end.strftime("%Y-%m-%dT%H:%M:%SZ")}}}]},
        }


def controller_ref(kind: str, name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": "batch/v1" if kind == "Job" else "apps/v1", "kind": kind, "name": name, "uid": uid,
            "controller": True}


def _knobs(container: Mapping[str, Any]) -> tuple[int, int]:
    from batchtune.engines import VLLM

    invocation = VLLM.read(container)
    return invocation.max_num_seqs or 0, invocation.gpu_memory_utilization_percent or 90


class FakeCluster:
    def __init__(self, world: World) -> None:
        self.w = world

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        dep = self.w.deployments.get(name)
        return copy.deepcopy(dep) if dep else None

    def batchtuning(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.w.tuning_reads += 1
        if self.w.tuning_read_fails:
            raise ConnectionError("the API server did not answer")
        return self.w.body() if name == self.w.name else None

    def owned(self, namespace: str, tuning_uid: str) -> Owned:
        def ours(obj: Mapping[str, Any]) -> bool:
            return any(r.get("uid") == tuning_uid for r in obj["metadata"].get("ownerReferences") or [])

        deps = {n: {"name": n, "uid": d["metadata"].get("uid")} for n, d in self.w.deployments.items() if ours(d)}
        jobs = {n: {"name": n, "uid": j["metadata"].get("uid"), "status": j.get("status") or {}}
                for n, j in self.w.jobs.items() if ours(j)}
        return Owned(deps, jobs)

    def trial_pods(self, namespace: str, tuning: str, index: int) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for p in self.w.pods.values()
                if p["metadata"]["labels"].get(LABEL_TUNING) == label_value(tuning)
                and p["metadata"]["labels"].get(LABEL_TRIAL) == str(index)
                and p["metadata"]["labels"].get(LABEL_COMPONENT) == "trial"]

    def replica_set_controller(self, namespace: str, name: str, uid: str) -> str | None:
        found = self.w.replica_sets.get(name)
        return found["controller"] if found and found["uid"] == uid else None

    def job_run(self, namespace: str, job: Mapping[str, Any]) -> JobRun:
        full = self.w.jobs[job["name"]]
        status = full.get("status") or {}
        pods = tuple(copy.deepcopy(p) for p in self.w.pods.values()
                     if p["metadata"]["labels"].get("batch.kubernetes.io/job-name") == job["name"])
        done, failed, ended = load_run_outcome(status, pods, job.get("uid"))

        def t(value: str | None) -> datetime | None:
            return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None
        return JobRun(done, failed, t(status.get("startTime")), t(ended), pods if done else ())

    def production_pods(self, namespace: str, selector: Mapping[str, Any]) -> list[dict[str, Any]]:
        match = selector.get("matchLabels") or {}
        return [{"metadata": {"name": f"llm-prod-{i}", "labels": dict(match)}, "spec": {"nodeName": "gpu-node-0"}}
                for i in range(self.w.production_replicas)]

    def nodes(self) -> list[dict[str, Any]] | None:
        return copy.deepcopy(self.w.nodes)

    def gpu_pods(self) -> list[dict[str, Any]] | None:
        if self.w.nodes is None:
            return None
        return [copy.deepcopy(p) for p in self.w.pods.values()]

    def gpu_intents(self, exclude_uid: str) -> list[int]:
        return list(self.w.intents)

    def services(self, namespace: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.w.services)

    def container_log(self, namespace: str, pod: str, container: str, previous: bool) -> str | None:
        self.w.logs_read.append((pod, previous))
        found = self.w.pods.get(pod)
        if found is None:
            return None
        return self.w.trial_log(*_knobs(found["spec"]["containers"][0]))

    def create(self, obj: Mapping[str, Any]) -> bool:
        name = obj["metadata"]["name"]
        store = self.w.deployments if obj["kind"] == "Deployment" else self.w.jobs
        if name in store:
            return False
        store[name] = copy.deepcopy(dict(obj))
        store[name]["metadata"].setdefault("uid", f"uid-{obj['kind'].lower()}-{name}")  # the API server's
        self.w.created.append(f"{obj['kind']}/{name}")
        return True

    def delete(self, kind: str, namespace: str, name: str) -> None:
        store = self.w.deployments if kind == "Deployment" else self.w.jobs
        if store.pop(name, None) is not None:
            self.w.deleted.append(f"{kind}/{name}")
            self.w.pods.pop(f"{name}-pod", None)  # garbage collection of its pods
            if kind == "Deployment":
                self.w.replica_sets.pop(f"{name}-rs", None)

    def patch_deployment(self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
        dep = self.w.deployments[name]
        if self.w.conflict_next_patch or dep["metadata"]["resourceVersion"] != resource_version \
                or patch["metadata"].get("resourceVersion") != resource_version:
            self.w.conflict_next_patch = False
            raise Conflict(f"{name} is at {dep['metadata']['resourceVersion']}, not {resource_version}")
        self.w.patches.append(copy.deepcopy(dict(patch)))
        annotations = dep["metadata"].setdefault("annotations", {})
        for key, value in (patch["metadata"].get("annotations") or {}).items():
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
        for change in ((patch.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []:
            for container in dep["spec"]["template"]["spec"]["containers"]:
                if container["name"] == change["name"]:
                    _apply_strategic(container, change)
            dep["metadata"]["generation"] += 1
            if self.w.rollout_done:
                dep["status"]["observedGeneration"] = dep["metadata"]["generation"]
            else:
                dep["status"]["updatedReplicas"] = 0
        dep["metadata"]["resourceVersion"] = self.w.next_rv()
        return copy.deepcopy(dep)

    def secret_value(self, namespace: str, name: str, key: str, label: str | None = None,
                     field: str = "spec.prometheus.authSecretRef") -> str:
        secret = self.w.secrets.get(name)
        if secret is None or secret.get("labels", {}).get(label or "batchtune.io/prometheus-token") != "true":
            raise NotAllowed(f"{field}: Secret {namespace}/{name} has not opted in")
        return str(secret["data"][key])

    def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        self.w.events.append((type_, reason, message))


class FakeReader:
    def __init__(self, world: World) -> None:
        self.w = world

    def _query(self) -> None:
        self.w.queries += 1
        if not self.w.prometheus_up:
            raise PrometheusUnavailable("http://127.0.0.1:9090: ConnectionError")

    def ping(self) -> None:
        self._query()

    def trial_run(self, namespace: str, pod: str, model: str | None, window: Window) -> dict[str, float | None]:
        self._query()
        trial = pod.removesuffix("-pod").rsplit("-", 1)[-1]
        jobs = [j for j in self.w.jobs.values() if j["metadata"]["labels"][LABEL_TRIAL] == trial and "figures" in j]
        if not jobs:
            return {}
        figures = dict(jobs[-1]["figures"])
        # Prometheus' histograms are coarse: the loop must prefer the load generator's exact numbers.
        figures[M.ITL_MS] = math.ceil(figures[M.ITL_MS] / 25) * 25
        return {k: float(v) for k, v in figures.items()}

    def production_window(self, production: Production, start: datetime, end: datetime) -> dict[str, float | None]:
        self._query()
        dep = self.w.deployments["llm"]
        if self.w.production_figures is not None:
            return self.w.production_figures(dep, start, end)
        seqs, gmu = _knobs(dep["spec"]["template"]["spec"]["containers"][0])
        figures = self.w.model(seqs, gmu, 8)
        seconds = (end - start).total_seconds()
        return {M.ITL_MS: figures[M.ITL_MS], M.TTFT_MS: figures[M.TTFT_MS], M.E2E_MS: figures[M.E2E_MS],
                M.ERROR_RATE_PERCENT: 0.0, "servedSharePercent": 100.0,
                M.REQUESTS: self.w.production_requests_per_second * seconds}

    def production_workload(self, production: Production, lookback_s: int, window_s: int) -> WorkloadObservation | None:
        self._query()
        traffic = self.w.traffic
        if traffic is None:
            return None
        return replace(traffic, lookback_seconds=lookback_s, window_seconds=window_s, replicas=len(production.pods))

    def production_peak_rate(self, production: Production, lookback_s: int) -> float | None:
        self._query()
        return self.w.production_peak_per_second

    def production_gpu_model(self, production: Production) -> str | None:
        self._query()
        return self.w.gpu_model

    def scrape_interval(self, production: Production, where: str) -> ScrapeInterval | None:
        self._query()
        self.w.scrape_lookups += 1
        return self.w.scrape_interval


class FakeMetrics:
    def __init__(self, world: World) -> None:
        self.w = world

    def reader(self, url: Any, token: str | None, ctx: Any, engine: Any, owner: str) -> FakeReader:
        return FakeReader(self.w)


class FakeReports:
    def __init__(self, world: World) -> None:
        self.w = world
        self.submitted: list[str] = []

    def submit(self, namespace: str, name: str, uid: str, spec: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        self.submitted.append(name)


def reset_backoff() -> None:
    PROMETHEUS_BACKOFF.clear()


@pytest.fixture
def fresh_backoff() -> Iterator[None]:
    """The Prometheus back-off is process state: every test starts and ends without one."""
    reset_backoff()
    yield
    reset_backoff()


def tuning_world(**spec_overrides: Any) -> World:
    """A world with production's Deployment and a BatchTuning of `spec(**spec_overrides)`."""
    w = World(bt_spec=spec(**spec_overrides))
    w.deployments["llm"] = production_target()
    return w


def world(**spec_overrides: Any) -> World:
    """A world with production's Deployment `llm` and a BatchTuning of `spec(**spec_overrides)`."""
    w = World(bt_spec=spec(**spec_overrides))
    w.deployments["llm"] = production_target()
    return w
