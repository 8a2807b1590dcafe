"""A loopback stand-in for the API server's HTTP side: answers the requests the cluster port (`controller.kube`) and
the leader Lease (`controller.leader.KubeLease`) make with plausible JSON, and records each request as it came over
the wire (method, path and query, Accept and Content-Type, the body's JSON).

Used by `tests/unit/test_controller_kube_wire.py` (the port sends what the kubernetes client's typed API classes sent)
and `hack/bench-operator-memory kubeport` (what the port's first calls cost in memory).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit


def deployment(namespace: str, name: str, version: int = 5) -> dict[str, Any]:
    """A Deployment shaped like the scale benchmark's targets (a vLLM pod template), as the API server writes it."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "resourceVersion": str(version),
                     "generation": 1, "creationTimestamp": "2026-12-03T12:00:00Z", "labels": labels,
                     "managedFields": [{"manager": "kubectl", "operation": "Update", "apiVersion": "apps/v1",
                                        "time": "2026-12-03T12:00:00Z", "fieldsType": "FieldsV1",
                                        "fieldsV1": {"f:spec": {"f:replicas": {}}}}]},
        "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                     "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                     "args": ["--model", "meta-llama/Llama-3.1-70B-Instruct", "--max-num-seqs", "64"],
                                     "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}},
                                     "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}}}]}}},
        "status": {"observedGeneration": 1, "replicas": 0,
                   "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                                   "lastTransitionTime": "2026-12-03T12:00:01Z"}]},
    }


def pod(namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels,
                         "creationTimestamp": "2026-12-03T12:00:00Z",
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                                              "uid": "uid-rs", "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"nodeName": "node-0", "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                                           "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
            "status": {"phase": "Running", "podIP": "127.78.0.5",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "vllm", "ready": True, "restartCount": 0,
                                              "image": "vllm/vllm-openai:v0.11.0", "imageID": "",
                                              "state": {"running": {"startedAt": "2026-12-03T12:00:02Z"}}}]}}


def lease(namespace: str, name: str, version: int = 1) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(version)},
            "spec": {"holderIdentity": "replica-a", "leaseDurationSeconds": 15,
                     "acquireTime": "2026-12-03T12:00:00.000000Z", "renewTime": "2026-12-03T12:00:10.123456Z",
                     "leaseTransitions": 2}}


def replica_set(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": name, "namespace": namespace, "uid": "uid-rs",
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm",
                                              "uid": "uid-llm", "controller": True}]}}


def secret(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace, "labels": {"batchtune.io/secret": "true"}},
            "data": {"token": "c2VjcmV0"}}


def batchtuning(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "resourceVersion": "7"},
            "spec": {"targetRef": {"name": "llm"}}, "status": {"phase": "Trialing"}}


NAMED = {"replicasets": replica_set, "secrets": secret, "batchtunings": batchtuning, "leases": lease}
"""What a GET of one object answers, by the path's resource."""


class Recorded:
    def __init__(self, method: str, target: str, headers: Any, body: bytes) -> None:
        self.method, self.target = method, target
        self.accept, self.content_type = headers.get("Accept"), headers.get("Content-Type")
        self.body = json.loads(body) if body else None

    def key(self) -> tuple[Any, ...]:
        return (self.method, self.target, self.accept, self.content_type, json.dumps(self.body, sort_keys=True))


class FakeApiServer:
    """Answers by path; `status` maps a path (without the query) to an HTTP status to answer instead (404, 409...)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.status: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        self._lock = threading.Lock()

    def answer(self, method: str, target: str, body: Any) -> tuple[int, str, bytes]:
        path = urlsplit(target).path
        parts = path.strip("/").split("/")
        if path in self.status:
            code = self.status[path]
            reason = {404: "NotFound", 409: "Conflict", 403: "Forbidden"}.get(code, "Error")
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code,
                      "message": f"{path}: {reason}"}
            return code, "application/json", json.dumps(status).encode()
        rest = parts[parts.index("namespaces") + 1:] if "namespaces" in parts else ["default", parts[-1]]
        namespace, kind, name = (rest + [None, None])[:3]
        if path.endswith("/log"):
            return 200, "text/plain", "INFO starting\nERROR CUDA out of memory \u2013 tried 2 GiB\n".encode()
        if method in ("POST", "PUT"):
            obj = dict(body or {})
            meta = dict(obj.get("metadata") or {})
            with self._lock:
                self.versions[path] = self.versions.get(path, 0) + 1
                meta["resourceVersion"] = str(self.versions[path])
            obj["metadata"] = {**meta, "uid": f"uid-{meta.get('name')}"}
            return (201 if method == "POST" else 200), "application/json", json.dumps(obj).encode()
        if method == "DELETE":
            return 200, "application/json", json.dumps({"kind": "Status", "apiVersion": "v1",
                                                        "status": "Success"}).encode()
        if kind == "deployments" and name:
            found = deployment(namespace, name, 6 if method == "PATCH" else 5)
            if method == "PATCH":
                found["metadata"].setdefault("annotations", {}).update(
                    ((body or {}).get("metadata") or {}).get("annotations") or {})
            return 200, "application/json", json.dumps(found).encode()
        if kind in NAMED and name:
            return 200, "application/json", json.dumps(NAMED[kind](namespace, name)).encode()
        if kind == "pods":
            items = [pod(namespace, f"llm-{i}", {"app": "llm"}) for i in range(2)]
            return 200, "application/json", json.dumps({"kind": "PodList", "apiVersion": "v1",
                                                        "metadata": {"resourceVersion": "9"}, "items": items}).encode()
        if kind == "services":
            items = [{"metadata": {"name": "llm", "namespace": namespace},
                      "spec": {"selector": {"app": "llm"}, "ports": [{"port": 8000}]}}]
            return 200, "application/json", json.dumps({"kind": "ServiceList", "apiVersion": "v1",
                                                        "items": items}).encode()
        return 404, "application/json", json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}).encode()

    @contextmanager
    def serving(self) -> Iterator[str]:
        """Serve on a loopback port; yields its URL."""
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the API server: the client's pool reuses connections

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                recorded = Recorded(self.command, self.path, self.headers, raw)
                with server_self._lock:
                    server_self.requests.append(recorded)
                code, content_type, out = server_self.answer(self.command, self.path, recorded.body)
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any  # noqa: N815  # http.server's names

            def log_message(self, *_: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, name="fake-apiserver", daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
