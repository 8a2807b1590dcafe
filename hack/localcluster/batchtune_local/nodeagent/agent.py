"""The node agent: registers GPU nodes, keeps them alive, and runs their pods as local processes."""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchtune.gpu_activity import read_activity
from batchtune_local.nodeagent.images import ImageMap, load_image_map
from batchtune_local.nodeagent.logserver import LogServer, LogSource, ensure_certificate
from batchtune_local.nodeagent.metrics import GpuHolder, GpuSample, MetricsServer, pick_activity
from batchtune_local.nodeagent.pod import BASE_ENV_KEYS, NodeSettings, PodWorker
from batchtune_local.nodeagent.process import ContainerProcess
from batchtune_local.nodeagent.products import product_for_label
from batchtune_local.nodeagent.state import StateStore

log = logging.getLogger("batchtune_local.nodeagent")

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
LEASE_NAMESPACE = "kube-node-lease"


@dataclass(frozen=True)
class AgentConfig:
    kubeconfig: str | None
    state_dir: Path
    nodes: int = 2
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    metrics_address: str = "127.0.0.1:9400"
    image_map: str | None = None
    time_scale: float = 1.0
    node_prefix: str = "gpu-node-"
    pod_network: str = "127.1.0.0/16"
    cpu: str = "192"
    memory: str = "2Ti"
    max_pods: int = 110
    lease_duration_s: int = 40
    context: str | None = None
    kubelet_address: str = "127.0.0.1:0"
    """Where `kubectl logs` is served (TLS); port 0 picks one, "" turns it off."""
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()
    """Node taints ({key, value, effect}); a test pool uses one to keep other pods off."""
    idle_pods: bool = False
    """Every pod's processes at the lowest CPU priority (`process.lowest_cpu_priority`): a GPU node's pods do not
    share the control plane's CPUs, and on one machine they need not starve it."""

    @property
    def node_names(self) -> list[str]:
        return [f"{self.node_prefix}{i}" for i in range(self.nodes)]

    def resources(self) -> dict[str, str]:
        return {
            "cpu": self.cpu, "memory": self.memory, "pods": str(self.max_pods),
            "ephemeral-storage": "1Ti", "nvidia.com/gpu": str(self.gpus_per_node),
        }


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now_seconds() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_manifest(config: AgentConfig, name: str, kubelet_version: str, kubelet_port: int = 0) -> dict[str, Any]:
    """The Node object a kubelet would register, with GPUs as an extended resource."""
    labels = {
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "nvidia.com/gpu.product": config.gpu_product, "nvidia.com/gpu.count": str(config.gpus_per_node),
        "nvidia.com/gpu.present": "true", "batchtune.io/node-agent": "true",
    }
    labels.update(config.extra_labels)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"taints": [dict(t) for t in config.taints]} if config.taints else {},
        "status": node_status(config, name, kubelet_version, kubelet_port),
    }


def node_status(config: AgentConfig, name: str, kubelet_version: str, kubelet_port: int = 0) -> dict[str, Any]:
    stamp = now_seconds()

    def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
                "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}

    return {
        "capacity": config.resources(),
        "allocatable": config.resources(),
        "conditions": [
            cond("MemoryPressure", False, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", False, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", False, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond("Ready", True, "KubeletReady", "batchtune node agent is posting ready status"),
        ],
        # No Hostname address: the API server would resolve the node name through DNS for `kubectl logs`.
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "machineID": name, "systemUUID": name, "bootID": name, "kernelVersion": os.uname().release,
            "osImage": "batchtune node agent", "containerRuntimeVersion": "batchtune-local://0.1",
            "kubeletVersion": kubelet_version, "kubeProxyVersion": "", "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


def _iter_lines(resp: Any) -> Iterator[str]:
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False) if hasattr(resp, "stream") else [resp.read()]:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line.decode("utf-8")
    if buffer.strip():
        yield buffer.decode("utf-8")


def _body(resp: Any) -> Any:
    raw = resp.data if getattr(resp, "data", None) is not None else resp.read()
    return json.loads(raw)


class KubeApi:
    """The few API calls the agent makes, on dicts (no model classes in the hot path)."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        cfg.connection_pool_maxsize = 64  # one per pod worker and watch
        self.client = client
        self.api_client = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self.version = client.VersionApi(self.api_client)

    @staticmethod
    def status_of(exc: Exception) -> int | None:
        return getattr(exc, "status", None)

    # PodApi ---------------------------------------------------------------------------------------
    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status}, _content_type=MERGE,
                                                  _preload_content=False)
        except self.client.ApiException as exc:
            if exc.status != 404:
                raise

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=0,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}, _preload_content=False,
            )
        except self.client.ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or a new pod of the same name
                raise

    def config_map(self, namespace: str, name: str) -> Mapping[str, str] | None:
        try:
            body = _body(self.core.read_namespaced_config_map(name, namespace, _preload_content=False))
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(body.get("data") or {})

    def secret(self, namespace: str, name: str) -> Mapping[str, str] | None:
        try:
            body = _body(self.core.read_namespaced_secret(name, namespace, _preload_content=False))
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (body.get("data") or {}).items()}


    def service_account_kubeconfig(self, pod: Mapping[str, Any]) -> str | None:
        """A kubeconfig with a pod-bound token of the pod's ServiceAccount, as the kubelet's projected
        token mount gives a real pod; None when the pod opts out or the token cannot be had."""
        spec, meta = pod.get("spec") or {}, pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        account = spec.get("serviceAccountName") or "default"
        request = {"spec": {"expirationSeconds": 86400,
                            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                               "uid": meta.get("uid")}}}
        try:
            body = _body(self.core.create_namespaced_service_account_token(
                account, meta["namespace"], request, _preload_content=False))
        except self.client.ApiException:
            return None
        cfg = self.api_client.configuration
        cluster = {"server": cfg.host}
        if cfg.ssl_ca_cert:
            cluster["certificate-authority"] = cfg.ssl_ca_cert
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "local", "cluster": cluster}],
            "users": [{"name": account, "user": {"token": body["status"]["token"]}}],
            "contexts": [{"name": "pod", "context": {"cluster": "local", "user": account,
                                                     "namespace": meta["namespace"]}}],
        })

    def event(self, pod: Mapping[str, Any], container: str, kind: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        stamp = now_seconds()
        container_list = "initContainers" if any(
            c.get("name") == container for c in (pod.get("spec") or {}).get("initContainers") or []) else "containers"
        self.core.create_namespaced_event(meta["namespace"], {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                               "uid": meta["uid"], "fieldPath": f"spec.{container_list}{{{container}}}"},
            "type": kind, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": "kubelet", "host": (pod.get("spec") or {}).get("nodeName", "")},
            "reportingComponent": "kubelet", "reportingInstance": (pod.get("spec") or {}).get("nodeName", ""),
        }, _preload_content=False)


class NodeAgent:
    def __init__(self, config: AgentConfig, api: KubeApi | None = None) -> None:
        self.config = config
        self.api = api or KubeApi(config.kubeconfig, config.context)
        self.image_map: ImageMap = load_image_map(config.image_map)
        self.product = product_for_label(config.gpu_product)
        self.store = StateStore(config.state_dir, config.pod_network)
        self.stop_event = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.workers_lock = threading.Lock()
        self.node_uids: dict[str, str] = {}
        self.kubelet_version = "v0.0.0"
        base_env = {k: os.environ[k] for k in BASE_ENV_KEYS if k in os.environ}
        self.settings = {
            node: NodeSettings(
                node=node, gpu_product=config.gpu_product, gpus_per_node=config.gpus_per_node,
                image_map=self.image_map, state_dir=Path(config.state_dir), time_scale=config.time_scale,
                allocatable=config.resources(), base_env=base_env, idle_pods=config.idle_pods,
            )
            for node in config.node_names
        }
        self.metrics = MetricsServer(config.metrics_address, self.gpu_samples)
        self.log_server: LogServer | None = None
        if config.kubelet_address:
            cert = ensure_certificate(Path(config.state_dir) / "kubelet-tls")
            if cert is None:
                log.warning("No openssl found: kubectl logs will not work")
            else:
                self.log_server = LogServer(config.kubelet_address, cert, self.find_log)
        self.threads: list[threading.Thread] = []

    # ---- lifecycle -----------------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_event.set())
        self.start()
        try:
            while not self.stop_event.wait(1.0):
                pass
        finally:
            self.shutdown()
        return 0

    def start(self) -> None:
        try:
            self.kubelet_version = str(_body(self.api.version.get_code(_preload_content=False))["gitVersion"])
        except Exception as exc:  # only cosmetic: kubectl's VERSION column
            log.warning("Server version was not readable: %s", exc)
        for node in self.config.node_names:
            self._retry(lambda n=node: self.register_node(n), f"Node {node} registration")
        self.metrics.start()
        log.info("Metrics are served on http://%s/metrics", self.metrics.address)
        if self.log_server is not None:
            self.log_server.start()
            log.info("Container logs are served on https://127.0.0.1:%d (kubectl logs)", self.log_server.port)
        resource_versions = {node: self._retry(lambda n=node: self.relist(n), f"Node {node} pod list")
                             for node in self.config.node_names}
        self.collect_orphans()
        self._spawn(self.heartbeat_loop, "heartbeat")
        for node in self.config.node_names:
            self._spawn(lambda n=node: self.watch_loop(n, resource_versions[n]), f"watch-{node}")
        log.info("Node agent is running %d nodes x %d %s GPUs (state in %s)", self.config.nodes,
                 self.config.gpus_per_node, self.config.gpu_product, self.config.state_dir)

    def _retry(self, call: Any, what: str, attempts: int = 30) -> Any:
        """Start-up calls wait out an API server that is still coming up (1 s apart)."""
        for attempt in range(attempts):
            try:
                return call()
            except Exception as exc:
                if attempt == attempts - 1 or self.stop_event.is_set():
                    raise
                log.warning("%s failed, retrying: %s", what, exc)
                self.stop_event.wait(1.0)
        raise AssertionError("unreachable")

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def shutdown(self) -> None:
        log.info("Node agent is stopping its pods' processes")
        self.stop_event.set()
        with self.workers_lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.shutdown()
        for worker in workers:
            if worker.thread is not None:
                worker.thread.join(15.0)
            else:
                worker.tick()
        self.metrics.stop()
        if self.log_server is not None:
            self.log_server.stop()
        log.info("Node agent stopped")

    # ---- nodes ---------------------------------------------------------------------------------
    def register_node(self, node: str) -> None:
        manifest = node_manifest(self.config, node, self.kubelet_version,
                                 self.log_server.port if self.log_server else 0)
        try:
            created = _body(self.api.core.create_node(manifest, _preload_content=False))
            log.info("Node %s was registered", node)
        except self.api.client.ApiException as exc:
            if exc.status != 409:
                raise
            created = _body(self.api.core.patch_node(
                node, {"metadata": {"labels": manifest["metadata"]["labels"]}, "spec": manifest["spec"]},
                _content_type=STRATEGIC,
                _preload_content=False))
            # A merge patch replaces the lists, so addresses/conditions of an older agent do not linger.
            self.api.core.patch_node_status(node, {"status": manifest["status"]}, _content_type=MERGE,
                                            _preload_content=False)
            log.info("Node %s was re-registered", node)
        self.node_uids[node] = created["metadata"]["uid"]
        self.renew_lease(node)

    def renew_lease(self, node: str) -> None:
        body = {"spec": {"holderIdentity": node, "leaseDurationSeconds": self.config.lease_duration_s,
                         "renewTime": now_micro()}}
        try:
            self.api.coordination.patch_namespaced_lease(node, LEASE_NAMESPACE, body, _content_type=MERGE,
                                                         _preload_content=False)
        except self.api.client.ApiException as exc:
            if exc.status != 404:
                raise
            lease = {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": node, "namespace": LEASE_NAMESPACE, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": node, "uid": self.node_uids.get(node, "")}]},
                **body,
            }
            self.api.coordination.create_namespaced_lease(LEASE_NAMESPACE, lease, _preload_content=False)

    def heartbeat_loop(self) -> None:
        """Lease every 10 s (what node lifecycle watches), Ready condition every 60 s."""
        last_status = time.monotonic()
        while not self.stop_event.wait(10.0):
            status_due = time.monotonic() - last_status >= 60.0
            for node in self.config.node_names:
                try:
                    self.renew_lease(node)
                    if status_due:
                        status = node_status(self.config, node, self.kubelet_version)
                        patch = {"status": {"conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                                           for c in status["conditions"]]}}
                        self.api.core.patch_node_status(node, patch, _content_type=STRATEGIC, _preload_content=False)
                except Exception as exc:
                    log.warning("Node %s: heartbeat failed: %s", node, exc)
                    if self.api.status_of(exc) == 404:
                        try:
                            self.register_node(node)
                        except Exception as again:
                            log.warning("Node %s: re-registration failed: %s", node, again)
            if status_due:
                last_status = time.monotonic()
                try:
                    self.collect_orphans(check_api=True)
                except Exception as exc:
                    log.warning("Orphan sweep failed: %s", exc)

    # ---- pods ----------------------------------------------------------------------------------
    def relist(self, node: str) -> str:
        """List the node's pods, hand each to its worker, stop workers of pods that are gone."""
        body = _body(self.api.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _preload_content=False))
        seen = set()
        for pod in body.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self.dispatch(node, "MODIFIED", pod)
        with self.workers_lock:
            gone = [w for uid, w in self.workers.items() if w.settings.node == node and uid not in seen]
        for worker in gone:
            worker.removed()
        return str(body["metadata"]["resourceVersion"])

    def watch_loop(self, node: str, resource_version: str) -> None:
        while not self.stop_event.is_set():
            try:
                resp = self.api.core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node}", watch=True, resource_version=resource_version,
                    allow_watch_bookmarks=True, timeout_seconds=300, _preload_content=False,
                    _request_timeout=(10, 330),
                )
                for line in _iter_lines(resp):
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
                    resource_version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self.dispatch(node, event["type"], obj)
                    if self.stop_event.is_set():
                        break
            except Exception as exc:
                if self.stop_event.is_set():
                    break
                log.warning("Node %s: pod watch broke (%s); relisting", node, exc)
                self.stop_event.wait(1.0)
                try:
                    resource_version = self.relist(node)
                except Exception as again:
                    log.warning("Node %s: relist failed: %s", node, again)

    def dispatch(self, node: str, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.workers_lock:
            for done in [k for k, w in self.workers.items() if w.done]:
                del self.workers[done]
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.removed()
                return
            if worker is not None:
                worker.update(pod)
                return
            if self.stop_event.is_set():
                return
            try:
                worker = PodWorker(pod, self.settings[node], self.store, self.api)
            except Exception:  # one bad pod must not stall the watch of the whole node
                log.exception("Pod %s/%s could not be set up", pod["metadata"]["namespace"], pod["metadata"]["name"])
                return
            self.workers[uid] = worker
        log.info("Pod %s/%s was admitted on %s", pod["metadata"]["namespace"], pod["metadata"]["name"], node)
        worker.start()

    def collect_orphans(self, check_api: bool = False) -> None:
        """Kill processes and free allocations recorded for pods that no longer exist.

        At start-up the fresh pod lists are the truth; later (`check_api`) a record without a
        live worker is dropped only when the API confirms its pod is gone.
        """
        with self.workers_lock:
            live = {uid for uid, w in self.workers.items() if not w.done}
        for uid, record in self.store.pods().items():
            if uid in live:
                continue
            if check_api and self._pod_exists(record["namespace"], record["name"], uid):
                continue
            for container, entry in record.get("processes", {}).items():
                process = ContainerProcess.adopt(int(entry["pid"]), int(entry["ticks"]))
                if process is not None:
                    log.info("Pod %s/%s is gone; its orphan container %s (pid %d) was killed",
                             record["namespace"], record["name"], container, process.pid)
                    process.signal(signal.SIGKILL)
            self.store.forget(uid)

    def _pod_exists(self, namespace: str, name: str, uid: str) -> bool:
        try:
            body = _body(self.api.core.read_namespaced_pod(name, namespace, _preload_content=False))
        except self.api.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return bool(body["metadata"]["uid"] == uid)

    # ---- logs --------------------------------------------------------------------------------------
    def find_log(self, namespace: str, name: str, container: str, previous: bool) -> LogSource | None:
        with self.workers_lock:
            worker = next((w for w in self.workers.values()
                           if not w.done and w.key == f"{namespace}/{name}"), None)
        if worker is not None:
            runtime = next((c for c in worker.init_containers + worker.containers if c.name == container), None)
            if runtime is None:
                return None
            path = worker.log_dir / f"{container}.log"
            if previous:
                return LogSource(path, 0, runtime.log_offset, lambda: False)
            return LogSource(path, runtime.log_offset, None,
                             lambda: runtime.process is not None and not worker.done and not self.stop_event.is_set())
        # A pod from before an agent restart: its whole log file.
        for directory in (Path(self.config.state_dir) / "logs").glob(f"{namespace}_{name}_*"):
            return LogSource(directory / f"{container}.log", 0, None, lambda: False)
        return None

    # ---- metrics -------------------------------------------------------------------------------
    def gpu_samples(self) -> list[GpuSample]:
        samples: list[GpuSample] = []
        pods = self.store.pods()
        for node in self.config.node_names:
            holders = self.store.gpu_holders(node)
            for index in range(self.config.gpus_per_node):
                holder, activity = None, None
                if index in holders:
                    uid, container = holders[index]
                    record = pods.get(uid)
                    if record is not None:
                        position = record["gpus"][container].index(index)
                        holder = GpuHolder(record["namespace"], record["name"], container, position)
                        path = (Path(self.config.state_dir) / "pods" / f"{record['namespace']}_{record['name']}_{uid}"
                                / ".batchtune" / f"{container}.gpu-activity.json")
                        activity = pick_activity(read_activity(path), position)
                samples.append(GpuSample(node, index, self.product, holder, activity))
        return samples
