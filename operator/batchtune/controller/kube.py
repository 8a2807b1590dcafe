"""Every call the operator makes to the Kubernetes API, in one place (official `kubernetes` client)."""

from __future__ import annotations

import json
import logging
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from batchtune import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger(__name__)

FIELD_MANAGER = "batchtune"
TUNING_LABEL = "batchtune.io/tuning"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


def load_config() -> None:
    global _CLIENT
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    _CLIENT = None  # built from the configuration just loaded


_CLIENT: client.ApiClient | None = None


def _api() -> client.ApiClient:
    # One client, one connection pool: a client per call opened a new TLS connection per request.
    global _CLIENT
    if _CLIENT is None:
        cfg = client.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = 32  # one per reconcile worker thread
        _CLIENT = client.ApiClient(cfg)
    return _CLIENT


def _sanitize(obj: Any) -> Any:
    return _api().sanitize_for_serialization(obj)


def apps() -> client.AppsV1Api:
    return client.AppsV1Api(_api())


def core() -> client.CoreV1Api:
    return client.CoreV1Api(_api())


def batch() -> client.BatchV1Api:
    return client.BatchV1Api(_api())


def get_deployment(namespace: str, name: str) -> dict | None:
    try:
        return _sanitize(apps().read_namespaced_deployment(name, namespace))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def create_if_missing(obj: dict) -> bool:
    """Creates a Deployment, Job or ConfigMap unless one of that name exists; True when created."""
    kind, ns = obj["kind"], obj["metadata"]["namespace"]
    try:
        if kind == "Deployment":
            apps().create_namespaced_deployment(ns, obj, field_manager=FIELD_MANAGER)
        elif kind == "Job":
            batch().create_namespaced_job(ns, obj, field_manager=FIELD_MANAGER)
        elif kind == "ConfigMap":
            core().create_namespaced_config_map(ns, obj, field_manager=FIELD_MANAGER)
        else:
            raise ValueError(f"unsupported kind {kind!r}")
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True


def list_owned(namespace: str, tuning: str) -> tuple[list[dict], list[dict]]:
    """Trial Deployments and load Jobs labelled as belonging to this BatchTuning."""
    from batchtune.core.manifests import label_value

    selector = f"{TUNING_LABEL}={label_value(tuning)}"
    deployments = apps().list_namespaced_deployment(namespace, label_selector=selector).items
    jobs = batch().list_namespaced_job(namespace, label_selector=selector).items
    return [_sanitize(d) for d in deployments], [_sanitize(j) for j in jobs]


def list_pods(namespace: str, selector: str) -> list[dict]:
    return [_sanitize(p) for p in core().list_namespaced_pod(namespace, label_selector=selector).items]


def delete_deployment(namespace: str, name: str) -> None:
    _delete(lambda: apps().delete_namespaced_deployment(
        name, namespace, propagation_policy="Background", grace_period_seconds=5))


def delete_job(namespace: str, name: str) -> None:
    _delete(lambda: batch().delete_namespaced_job(name, namespace, propagation_policy="Background"))


def _delete(call) -> None:
    try:
        call()
    except ApiException as exc:
        if exc.status != 404:
            raise


def delete_owned(namespace: str, tuning: str) -> int:
    deployments, jobs = list_owned(namespace, tuning)
    for job in jobs:
        delete_job(namespace, job["metadata"]["name"])
    for dep in deployments:
        delete_deployment(namespace, dep["metadata"]["name"])
    return len(deployments) + len(jobs)


def patch_container_args(namespace: str, deployment: str, container: str, command: list[str] | None,
                         args: list[str] | None, annotations: dict[str, str | None]) -> dict:
    """Sets one container's command/args (only those) and our annotations on the Deployment.

    None removes the field (strategic merge), so a rollback restores an unset command exactly.
    """
    patch: dict[str, Any] = {
        "metadata": {"annotations": annotations},
        "spec": {"template": {"spec": {"containers": [{"name": container, "command": command, "args": args}]}}},
    }
    result = apps().patch_namespaced_deployment(deployment, namespace, patch, field_manager=FIELD_MANAGER)
    return _sanitize(result)


def nodes() -> list[dict] | None:
    """All nodes, or None when our identity may not list them (namespaced install)."""
    try:
        return [_sanitize(n) for n in core().list_node().items]
    except ApiException as exc:
        if exc.status == 403:
            return None
        raise


def gpu_pods_on_nodes(node_names: set[str]) -> list[dict] | None:
    try:
        pods = core().list_pod_for_all_namespaces(field_selector="status.phase!=Succeeded,status.phase!=Failed").items
    except ApiException as exc:
        if exc.status == 403:
            return None
        raise
    # Pending pods not yet bound count too: they are about to take GPUs on these nodes.
    return [_sanitize(p) for p in pods if p.spec.node_name in node_names or not p.spec.node_name]


def upsert_configmap(namespace: str, name: str, data: dict[str, str], binary: dict[str, str],
                     owner: dict, labels: dict[str, str]) -> None:
    body = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": [owner]},
        "data": data, "binaryData": binary,
    }
    try:
        core().replace_namespaced_config_map(name, namespace, body, field_manager=FIELD_MANAGER)
    except ApiException as exc:
        if exc.status != 404:
            raise
        core().create_namespaced_config_map(namespace, body, field_manager=FIELD_MANAGER)


def read_secret_key(namespace: str, name: str, key: str) -> str:
    import base64

    secret = core().read_namespaced_secret(name, namespace)
    data = (secret.data or {}).get(key)
    if data is None:
        raise KeyError(f"secret {namespace}/{name} has no key {key!r}")
    return base64.b64decode(data).decode()


def get_batchtuning(namespace: str, name: str) -> dict | None:
    try:
        return client.CustomObjectsApi(_api()).get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
