"""The Kubernetes side of the ports (`ports.Cluster`), over kopf indexes and the official client.

Owned Deployments and Jobs, batchtune's pods, GPU pods, nodes and other BatchTunings' GPU intents
come from kopf indexes fed by watches (`handlers.py` declares them), so a tick lists nothing. The
target Deployment is read once and served from `DeploymentCache` while the watch-fed index of every
Deployment's resourceVersion says it has not changed (its resourceVersion is the precondition of every
patch, which the API server refuses when stale); production's pods, Services and an opted-in Secret are
read when a phase needs them.

Every request goes through the official client's `ApiClient` (its configuration, credentials, TLS and connection
pool) by path, not through its typed API classes (`AppsV1Api`, `CoreV1Api`, ...): importing those loads hundreds
of pydantic model modules they name in their signatures (~26 MB of the operator's RSS, on its first tick), and the
port reads and writes plain JSON anyway. `request` sends what those classes send (tests/unit/test_controller_kube_wire.py).
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from batchtune import API_GROUP, API_VERSION, KIND, PLURAL
from batchtune.controller.ports import Conflict, JobRun, NotAllowed, Owned
from batchtune.core.manifests import (
    COMPONENT_LOAD,
    COMPONENT_TRIAL,
    LABEL_COMPONENT,
    LABEL_TRIAL,
    LABEL_TUNING,
    label_value,
)
from batchtune.core.pods import load_run_outcome

log = logging.getLogger(__name__)

FIELD_MANAGER = "batchtune"
# vLLM prints a startup failure's cause ~90 lines above its last line, beyond the termination message's tail.
LOG_TAIL_LINES = 400
LOG_LIMIT_BYTES = 64 * 1024
_CLIENT: client.ApiClient | None = None


def load_config() -> None:
    global _CLIENT
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]  # the kubernetes client is untyped here
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]  # the kubernetes client is untyped here
    _CLIENT = None  # built from the configuration just loaded


def api() -> client.ApiClient:
    # One client, one connection pool: a client per call opened a new TLS connection per request.
    global _CLIENT
    if _CLIENT is None:
        cfg = client.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = 32  # one per reconcile worker thread
        _CLIENT = client.ApiClient(cfg)
    return _CLIENT


ACCEPT = ["application/json", "application/yaml", "application/vnd.kubernetes.protobuf", "application/cbor"]
"""What the typed API classes offer the API server (the client picks JSON of them)."""
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
"""The patch type the typed `patch_namespaced_*` sent for an object body (the client's REST layer turns its default,
JSON Patch, into this for anything but a list)."""


def request(method: str, path: str, path_params: Mapping[str, str] | None = None,
            query: Iterable[tuple[str, Any]] = (), body: Any = None, content_type: str | None = None,
            timeout: float | None = None, via: client.ApiClient | None = None) -> Any:
    """One request to the API server over the shared client, as the typed API classes send it: `path` a template
    such as `/apis/apps/v1/namespaces/{namespace}/deployments/{name}`, `query` in the order they send it (None values
    left out), the body a plain dict, `via` another client than the shared one. Returns the response unread
    (urllib3's; read it with `read_json` or `_text`); raises ApiException for a non-2xx, as the typed call with
    `_preload_content=False` did."""
    client_ = via if via is not None else api()
    headers: dict[str, Any] = {"Accept": client_.select_header_accept(ACCEPT)}
    if content_type:
        headers["Content-Type"] = content_type
    serialized = client_.param_serialize(
        method=method, resource_path=path, path_params=dict(path_params or {}),
        query_params=[(k, v) for k, v in query if v is not None], header_params=headers, body=body, post_params=[],
        files={}, auth_settings=["BearerToken"], collection_formats={})
    response = client_.call_api(*serialized, _request_timeout=timeout)
    if not 200 <= response.status <= 299:
        response.read()  # type: ignore[no-untyped-call]  # the kubernetes client is untyped here
        raise ApiException.from_response(http_resp=response, body=None, data=None)
    return response.response


def read_json(response: Any) -> Any:
    """The API server's JSON of a response from `request`: no model class is built or filled (the client's typed
    reads build one for every kind they deserialize, tens of MB on the operator's first ticks and CPU on every read)."""
    try:
        data = response.data
    finally:
        response.release_conn()
    return json.loads(data) if data else {}


def _text(response: Any) -> str:
    """A text response from `request` (a container's log) decoded as the typed client decoded a `str` answer."""
    try:
        data = response.data
    finally:
        response.release_conn()
    content_type = response.headers.get("content-type")
    match = re.search(r"charset=([a-zA-Z\-\d]+)[\s;]?", content_type) if content_type is not None else None
    return str(api().deserialize(data.decode(match.group(1) if match else "utf-8"), "str", content_type))


def _body(obj: Mapping[str, Any]) -> Any:
    """A plain dict as a request body."""
    return dict(obj)


_APPS = "/apis/apps/v1/namespaces/{namespace}/"
_BATCH = "/apis/batch/v1/namespaces/{namespace}/"
_CORE = "/api/v1/namespaces/{namespace}/"
_BATCHTUNINGS = f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{{namespace}}/{PLURAL}"
_COLLECTIONS = {"Deployment": _APPS + "deployments", "Job": _BATCH + "jobs", "ConfigMap": _CORE + "configmaps"}


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


# ---- what the indexes keep (small: only the fields the loop reads) ---------------------------


def owner_uid(meta: Mapping[str, Any]) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(API_GROUP + "/"):
            return str(ref.get("uid"))
    return None


def controller_refs(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The object's controller ownerReference, as `core.ownership.controller_owner` reads it (the rest is not kept)."""
    return [{k: ref.get(k) for k in ("apiVersion", "kind", "name", "uid", "controller")}
            for ref in meta.get("ownerReferences") or [] if ref.get("controller") is True]


def pod_digest(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return {
        "metadata": {**{k: meta.get(k) for k in ("name", "namespace", "labels", "creationTimestamp",
                                                  "deletionTimestamp")},
                     "ownerReferences": controller_refs(meta)},
        "spec": {"nodeName": spec.get("nodeName"),
                 # Init containers too: an accelerator an init container holds counts (core.gpus.pod_accelerators).
                 **{kind: [{"name": c.get("name"), "resources": c.get("resources") or {}} for c in spec.get(kind) or []]
                    for kind in ("containers", "initContainers")}},
        "status": {k: status.get(k) for k in ("phase", "podIP", "conditions", "containerStatuses")},
    }


@dataclass(frozen=True)
class Indexes:
    """kopf indexes, as handed to the timer (None: not declared in this install)."""

    owned_deployments: Mapping[Any, Iterable[Any]]
    owned_jobs: Mapping[Any, Iterable[Any]]
    batchtune_pods: Mapping[Any, Iterable[Any]]
    gpu_pods: Mapping[Any, Iterable[Any]] | None = None
    nodes: Mapping[Any, Iterable[Any]] | None = None
    tuning_intents: Mapping[Any, Iterable[Any]] | None = None
    deployment_versions: Mapping[Any, Iterable[Any]] | None = None
    """(namespace, name) -> the resourceVersion every Deployment's watch last delivered (None: not declared)."""


class DeploymentCache:
    """Target Deployments as last read, served again while the watch-fed index says their resourceVersion has not
    moved: a tick reads its target without a GET unless it changed (or the watch lags, which costs one GET more).

    A patch conditional on a cached resourceVersion is as safe as on a fresh one: when the object moved, the API
    server refuses it (409) and the tick reads again. Bounded: the least recently read entries go first."""

    def __init__(self, limit: int = 4096) -> None:
        self._entries: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit
        self.hits = self.misses = 0

    def get(self, namespace: str, name: str, indexed: str | None) -> dict[str, Any] | None:
        if indexed is None:
            return None
        with self._lock:
            found = self._entries.get((namespace, name))
            if found is None or found["metadata"].get("resourceVersion") != indexed:
                self.misses += 1
                return None
            self._entries.move_to_end((namespace, name))
            self.hits += 1
        return copy.deepcopy(found)

    def put(self, deployment: dict[str, Any]) -> None:
        meta = deployment.get("metadata") or {}
        with self._lock:
            self._entries[(str(meta.get("namespace")), str(meta.get("name")))] = copy.deepcopy(deployment)
            self._entries.move_to_end((str(meta.get("namespace")), str(meta.get("name"))))
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._entries.pop((namespace, name), None)


DEPLOYMENTS = DeploymentCache()


class ReplicaSetControllers:
    """ReplicaSet uid -> its controller's uid, as read once (a ReplicaSet's uid names one object for good, and a
    Deployment's ReplicaSets are not adopted by another): a trial pod's owner is checked with one GET per
    ReplicaSet, not per tick. Bounded: the oldest entries go first."""

    def __init__(self, limit: int = 4096) -> None:
        self._entries: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit

    def get(self, uid: str) -> tuple[bool, str | None]:
        with self._lock:
            return (uid in self._entries, self._entries.get(uid))

    def put(self, uid: str, controller: str | None) -> None:
        with self._lock:
            self._entries[uid] = controller
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)


REPLICA_SETS = ReplicaSetControllers()


class KubeCluster:
    """`ports.Cluster` for a real API server."""

    def __init__(self, indexes: Indexes, secret_label: str, cache: DeploymentCache | None = None) -> None:
        self.indexes = indexes
        self.secret_label = secret_label
        self.cache = cache if cache is not None else DEPLOYMENTS
        self.replica_sets = REPLICA_SETS

    # ---- reads ----------------------------------------------------------------------------

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        indexed = None
        if self.indexes.deployment_versions is not None:
            versions = list(self.indexes.deployment_versions.get((namespace, name), ()))
            indexed = str(versions[-1]) if versions else None
        cached = self.cache.get(namespace, name, indexed)
        if cached is not None:
            return cached
        try:
            found = dict(read_json(request("GET", _APPS + "deployments/{name}", {"namespace": namespace, "name": name})))
        except ApiException as exc:
            if exc.status == 404:
                self.cache.forget(namespace, name)
                return None
            raise
        self.cache.put(found)
        return found

    def batchtuning(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(read_json(request("GET", _BATCHTUNINGS + "/{name}", {"namespace": namespace, "name": name})))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def owned(self, namespace: str, tuning_uid: str) -> Owned:
        key = (namespace, tuning_uid)
        deployments = {d["name"]: d for d in self.indexes.owned_deployments.get(key, ())}
        jobs = {j["name"]: j for j in self.indexes.owned_jobs.get(key, ())}
        return Owned(deployments, jobs)

    def trial_pods(self, namespace: str, tuning: str, index: int) -> list[dict[str, Any]]:
        return list(self.indexes.batchtune_pods.get((namespace, label_value(tuning), str(index), COMPONENT_TRIAL), ()))

    def replica_set_controller(self, namespace: str, name: str, uid: str) -> str | None:
        known, controller = self.replica_sets.get(uid)
        if known:
            return controller
        try:
            found = read_json(request("GET", _APPS + "replicasets/{name}", {"namespace": namespace, "name": name}))
        except ApiException as exc:
            if exc.status == 404:
                return None  # gone, or never was: no pod of it is evidence
            raise
        meta = found.get("metadata") or {}
        if meta.get("uid") != uid:
            return None  # another ReplicaSet of that name: the pod's reference is not to it
        owner = next(iter(controller_refs(meta)), None)
        controller = str(owner["uid"]) if owner and owner.get("kind") == "Deployment" else None
        self.replica_sets.put(uid, controller)
        return controller

    def job_run(self, namespace: str, job: Mapping[str, Any]) -> JobRun:
        status = job.get("status") or {}
        pods = tuple(self.indexes.batchtune_pods.get((namespace, "job", str(job["name"])), ()))
        finished, failed, ended = load_run_outcome(status, pods, job.get("uid"))
        return JobRun(finished, failed, _time(status.get("startTime")), _time(ended), pods if finished else ())

    def production_pods(self, namespace: str, selector: Mapping[str, Any]) -> list[dict[str, Any]]:
        text = selector_text(selector)
        if text is None:
            return []
        pods = read_json(request("GET", _CORE + "pods", {"namespace": namespace}, [("labelSelector", text)]))
        return [pod_digest(p) for p in pods.get("items") or []]

    def nodes(self) -> list[dict[str, Any]] | None:
        if self.indexes.nodes is None:
            return None
        return list(self.indexes.nodes.get("all", ()))

    def gpu_pods(self) -> list[dict[str, Any]] | None:
        if self.indexes.gpu_pods is None:
            return None
        return list(self.indexes.gpu_pods.get("all", ()))

    def gpu_intents(self, exclude_uid: str) -> list[int]:
        if self.indexes.tuning_intents is None:
            return []
        out = []
        for uid, lists in self.indexes.tuning_intents.items():
            if uid == exclude_uid:
                continue
            for intent in (i for intents in lists for i in intents):
                pods = self.indexes.batchtune_pods.get(
                    (intent["namespace"], intent["tuning"], str(intent["index"]), COMPONENT_TRIAL), ())
                if not list(pods):
                    out.append(int(intent["gpus"]))
        return out

    def services(self, namespace: str) -> list[dict[str, Any]]:
        items = read_json(request("GET", _CORE + "services", {"namespace": namespace})).get("items") or []
        return [{"spec": {"selector": (s.get("spec") or {}).get("selector") or {}}} for s in items]

    def container_log(self, namespace: str, pod: str, container: str, previous: bool) -> str | None:
        try:
            return _text(request("GET", _CORE + "pods/{name}/log", {"namespace": namespace, "name": pod},
                                 [("container", container), ("limitBytes", LOG_LIMIT_BYTES), ("previous", previous),
                                  ("tailLines", LOG_TAIL_LINES)]))
        except ApiException as exc:
            if exc.status in (400, 403, 404):  # gone, not started, or the install may not read logs
                return None
            raise

    def secret_value(self, namespace: str, name: str, key: str, label: str | None = None,
                     field: str = "spec.prometheus.authSecretRef") -> str:
        label = label or self.secret_label
        try:
            secret = read_json(request("GET", _CORE + "secrets/{name}", {"namespace": namespace, "name": name}))
        except ApiException as exc:
            if exc.status in (403, 404):
                raise NotAllowed(f"{field}: Secret {namespace}/{name} cannot be read "
                                 f"(HTTP {exc.status}); the install grants Secret reads only in the namespaces it "
                                 "lists (Helm value prometheus.authSecretNamespaces)") from None
            raise
        labels = (secret.get("metadata") or {}).get("labels") or {}
        if labels.get(label) != "true":
            raise NotAllowed(f"{field}: Secret {namespace}/{name} has not opted in to batchtune "
                             f"(label {label}: \"true\")")
        data = (secret.get("data") or {}).get(key)
        if data is None:
            raise NotAllowed(f"{field}.key: Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data).decode()

    # ---- writes ---------------------------------------------------------------------------

    def create(self, obj: Mapping[str, Any]) -> bool:
        kind, ns = obj["kind"], obj["metadata"]["namespace"]
        if kind not in _COLLECTIONS:
            raise ValueError(f"unsupported kind {kind!r}")
        try:
            read_json(request("POST", _COLLECTIONS[kind], {"namespace": ns}, [("fieldManager", FIELD_MANAGER)], _body(obj)))
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def delete(self, kind: str, namespace: str, name: str) -> None:
        if kind not in ("Deployment", "Job"):
            raise ValueError(f"unsupported kind {kind!r}")
        grace = 5 if kind == "Deployment" else None
        try:
            read_json(request("DELETE", _COLLECTIONS[kind] + "/{name}", {"namespace": namespace, "name": name},
                          [("gracePeriodSeconds", grace), ("propagationPolicy", "Background")]))
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_deployment(self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
        if (patch.get("metadata") or {}).get("resourceVersion") != resource_version:
            raise ValueError("a production patch must carry the resourceVersion it was decided on")
        try:
            result = read_json(request("PATCH", _APPS + "deployments/{name}", {"namespace": namespace, "name": name},
                                   [("fieldManager", FIELD_MANAGER)], dict(patch), STRATEGIC_MERGE))
        except ApiException as exc:
            if exc.status == 409:
                self.cache.forget(namespace, name)
                raise Conflict(f"Deployment {namespace}/{name} changed since resourceVersion {resource_version}") from None
            raise
        patched = dict(result)
        self.cache.put(patched)
        return patched

    def event(self, namespace: str, name: str, uid: str, type_: str, reason: str, message: str) -> None:
        ref = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
               "metadata": {"name": name, "namespace": namespace, "uid": uid}}
        kopf.event(cast(kopf.Body, ref), type=type_, reason=reason, message=message)


def selector_text(selector: Mapping[str, Any]) -> str | None:
    """A label selector's text form (matchLabels and matchExpressions); None for an empty selector."""
    parts = [f"{k}={v}" for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In":
            parts.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            parts.append(str(key))
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts) or None


def upsert_configmap(body: Mapping[str, Any]) -> None:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    query = [("fieldManager", FIELD_MANAGER)]
    try:
        read_json(request("PUT", _CORE + "configmaps/{name}", {"namespace": ns, "name": name}, query, _body(body)))
    except ApiException as exc:
        if exc.status != 404:
            raise
        read_json(request("POST", _CORE + "configmaps", {"namespace": ns}, query, _body(body)))


__all__ = ["COMPONENT_LOAD", "FIELD_MANAGER", "Indexes", "KubeCluster", "LABEL_COMPONENT", "LABEL_TRIAL",
           "LABEL_TUNING", "controller_refs", "load_config", "owner_uid", "pod_digest", "selector_text", "upsert_configmap"]
