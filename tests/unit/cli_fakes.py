"""Test helpers for the user CLI: canned BatchTunings and a loopback fake of the few API server paths
the CLI reads, so the real `kubernetes` client and its error handling are exercised without a cluster."""

from __future__ import annotations

import base64
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BT_PATH = "/apis/batchtune.io/v1alpha1/namespaces/{ns}/batchtunings"
CM_PATH = "/api/v1/namespaces/{ns}/configmaps/{name}"

SLO = {"percentile": "P95", "interTokenLatencyMilliseconds": 50, "ttftMilliseconds": 2000}


def _trial(index: int, seqs: int, state: str, verdict: str | None, metrics: dict | None = None,
           reason: str | None = None, message: str | None = None, verdict_reason: str | None = None,
           gmu: int = 90) -> dict[str, Any]:
    trial: dict[str, Any] = {"index": index, "name": f"llama-8b-trial-{index}",
                             "setting": {"maxNumSeqs": seqs, "gpuMemoryUtilizationPercent": gmu},
                             "state": state, "startedAt": "2025-01-01T10:00:00Z"}
    for key, value in (("verdict", verdict), ("metrics", metrics), ("reason", reason), ("message", message),
                       ("verdictReason", verdict_reason)):
        if value is not None:
            trial[key] = value
    return trial


def _metrics(out: float, itl: float, gpu: float, ttft: float = 180.0, rps: float = 3.2) -> dict[str, float]:
    return {"outputThroughput": out, "requestThroughput": rps, "ttftMs": ttft, "itlMs": itl, "e2eMs": itl * 130,
            "gpuUtilPercent": gpu, "kvCacheUsagePercent": min(99.0, gpu * 0.8), "preemptionsPerSecond": 0.0}


def succeeded() -> dict[str, Any]:
    """A finished Auto-mode tuning: five measured trials, one infeasible, applied and verified."""
    return {
        "apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
        "metadata": {"name": "llama-8b", "namespace": "inference", "creationTimestamp": "2025-01-01T10:00:00Z",
                     "generation": 1, "uid": "u-1"},
        "spec": {"targetRef": {"name": "llama-8b"}, "searchSpace": {"maxNumSeqs": {"min": 16, "max": 512}},
                 "slo": dict(SLO), "prometheus": {"url": "http://prometheus:9090"}},
        "status": {
            "observedGeneration": 1, "phase": "Succeeded", "trialsPlanned": 6, "trialsCompleted": 6,
            "conditions": [
                {"type": "Progressing", "status": "False", "reason": "Verified", "message": "done",
                 "lastTransitionTime": "2025-01-01T10:40:00Z", "observedGeneration": 1},
                {"type": "Succeeded", "status": "True", "reason": "Verified",
                 "message": "max-num-seqs 128 verified on production: p95 ITL 41 ms <= 50 ms",
                 "lastTransitionTime": "2025-01-01T10:40:00Z", "observedGeneration": 1},
                {"type": "Failed", "status": "False", "reason": "Verified", "message": "",
                 "lastTransitionTime": "2025-01-01T10:40:00Z", "observedGeneration": 1},
            ],
            "trials": [
                _trial(0, 16, "Done", "Met", _metrics(610.4, 21.2, 41.0), "SloMet", verdict_reason="p95 ITL 21 ms"),
                _trial(1, 32, "Done", "Met", _metrics(1150.0, 24.9, 63.0), "SloMet", verdict_reason="p95 ITL 25 ms"),
                _trial(2, 64, "Done", "Met", _metrics(1980.7, 31.0, 84.0), "SloMet", verdict_reason="p95 ITL 31 ms"),
                _trial(3, 128, "Done", "Met", _metrics(2810.2, 41.3, 95.0), "SloMet", verdict_reason="p95 ITL 41 ms"),
                _trial(4, 256, "Done", "Violated", _metrics(3010.9, 77.5, 98.0), "SloViolated",
                       verdict_reason="p95 ITL 77.5 ms > 50 ms"),
                _trial(5, 512, "Infeasible", "Violated", None, "KvCacheTooSmall",
                       "ValueError: No available memory for the cache blocks.", gmu=95),
            ],
            "bestTrial": "llama-8b-trial-3", "bestSetting": "max-num-seqs 128, gmu 90%",
            "knee": {"maxNumSeqs": 128, "reason": "throughput +7% for latency +88% past 128"},
            "pruned": [{"setting": {"maxNumSeqs": 1024, "gpuMemoryUtilizationPercent": 90},
                        "reason": "DoesNotFitMemory", "message": "KV cache holds 301 sequences of 1024+128 tokens"}],
            "recommendation": {
                "setting": {"maxNumSeqs": 128, "gpuMemoryUtilizationPercent": 90},
                "args": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "128",
                         "--gpu-memory-utilization", "0.90"],
                "reason": "highest output throughput meeting p95 ITL 50 ms, 10% headroom below the knee",
                "jsonPatch": json.dumps([{"op": "replace", "path": "/spec/template/spec/containers/0/args",
                                          "value": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "128",
                                                    "--gpu-memory-utilization", "0.90"]}]),
                "kustomizePatch": "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: llama-8b\n",
                "replicasHint": 2,
            },
            "applied": {"target": "llama-8b",
                        "previous": {"args": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "256"]},
                        "new": {"args": ["meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "128"]},
                        "appliedAt": "2025-01-01T10:30:00Z", "verifiedAt": "2025-01-01T10:40:00Z"},
        },
    }


def trialing() -> dict[str, Any]:
    """A tuning in progress: two trials done, one measuring, no decision yet."""
    bt = succeeded()
    status = bt["status"]
    status.update({"phase": "Trialing", "trialsCompleted": 2, "trialsPlanned": 6})
    status["trials"] = status["trials"][:2] + [_trial(2, 64, "Measuring", None)]
    for key in ("bestTrial", "bestSetting", "knee", "recommendation", "applied"):
        status.pop(key)
    status["conditions"] = [{"type": "Progressing", "status": "True", "reason": "Planned",
                             "message": "6 trials planned", "lastTransitionTime": "2025-01-01T10:01:00Z"}]
    return bt


def failed() -> dict[str, Any]:
    bt = trialing()
    bt["status"].update({"phase": "Failed", "trialsCompleted": 3})
    bt["status"]["trials"][2].update({"state": "Done", "verdict": "Violated"})
    bt["status"]["conditions"] = [
        {"type": "Progressing", "status": "False", "reason": "NoFeasibleSetting", "message": "x",
         "lastTransitionTime": "2025-01-01T10:20:00Z"},
        {"type": "Failed", "status": "True", "reason": "NoFeasibleSetting",
         "message": "no trial met p95 ITL 50 ms; the smallest batch measured 61 ms",
         "lastTransitionTime": "2025-01-01T10:20:00Z"}]
    return bt


def fresh() -> dict[str, Any]:
    """Just applied: no status at all."""
    bt = succeeded()
    bt.pop("status")
    return bt


class FakeApi:
    """A loopback HTTP server answering GETs from a path -> (status, body) table; 404 for the rest."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, Any]] = {}
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                fake.requests.append(path)
                code, body = fake.routes.get(path, (404, {"kind": "Status", "apiVersion": "v1",
                                                          "status": "Failure", "reason": "NotFound",
                                                          "message": "the server could not find the requested "
                                                                     "resource", "code": 404}))
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_batchtuning(self, bt: dict[str, Any]) -> None:
        ns, name = bt["metadata"]["namespace"], bt["metadata"]["name"]
        self.routes[BT_PATH.format(ns=ns) + f"/{name}"] = (200, copy.deepcopy(bt))
        listed = self.routes.get(BT_PATH.format(ns=ns), (200, {"kind": "BatchTuningList", "items": []}))[1]
        listed["items"].append({"metadata": {"name": name, "namespace": ns}})
        self.routes[BT_PATH.format(ns=ns)] = (200, listed)

    def add_empty_list(self, ns: str) -> None:
        self.routes[BT_PATH.format(ns=ns)] = (200, {"kind": "BatchTuningList", "items": []})

    def add_report(self, ns: str, name: str, data: dict[str, str], binary: dict[str, bytes],
                   owner_uid: str | None = None) -> None:
        """The report ConfigMap; `owner_uid`: the BatchTuning that controls it (as the operator writes it)."""
        meta: dict[str, Any] = {"name": f"{name}-report", "namespace": ns}
        if owner_uid:
            meta["ownerReferences"] = [{"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "name": name,
                                        "uid": owner_uid, "controller": True, "blockOwnerDeletion": True}]
        self.routes[CM_PATH.format(ns=ns, name=f"{name}-report")] = (200, {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": data, "binaryData": {k: base64.b64encode(v).decode() for k, v in binary.items()}})

    def kubeconfig(self, path: Path, namespace: str | None = None) -> Path:
        context: dict[str, Any] = {"cluster": "fake", "user": "tester"}
        if namespace:
            context["namespace"] = namespace
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": context}],
        }))
        return path


def forbidden(message: str) -> tuple[int, dict[str, Any]]:
    return 403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                 "message": message, "code": 403}
