"""`up`/`status`/`down` on a second cluster in its own state dir: down leaves no process and no port of ours.

The second cluster uses its own ports and pod network, so the shared session cluster is untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import batchtune_local as lc
from batchtune_local import processes

pytestmark = pytest.mark.integration

HACK = Path(__file__).resolve().parents[2] / "hack" / "localcluster"


def _hack(command: str, state_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # The classic lane takes BATCHTUNE_CLUSTER_DIR as it is (another lane or an xdist worker would suffix it).
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env.update(BATCHTUNE_CLUSTER_DIR=str(state_dir), BATCHTUNE_LANE="0")
    return subprocess.run([str(HACK / command), *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture
def second_cluster(tmp_path: Path, cluster: lc.ClusterInfo):
    """A second cluster started through hack/localcluster/up; stopped even if the test fails."""
    state = tmp_path / "cluster"
    started = _hack("up", state, "--nodes", "1", "--gpus-per-node", "2", "--pod-network", lc.lanes.scratch_network())
    assert started.returncode == 0, started.stderr
    yield state
    _hack("down", state)


def test_up_twice_reports_the_running_cluster(second_cluster):
    again = _hack("up", second_cluster)
    assert again.returncode == 0, again.stderr
    assert "already up and healthy" in again.stdout


def test_status_lists_every_component_healthy(second_cluster):
    status = _hack("status", second_cluster)
    assert status.returncode == 0, status.stdout + status.stderr
    info = lc.load(second_cluster)
    assert info is not None
    for proc in info.processes:
        assert f"{proc.name:<25} {proc.pid:>8}" in status.stdout and "healthy" in status.stdout


def test_down_leaves_no_process_and_no_port(second_cluster, wait_for):
    info = lc.load(second_cluster)
    assert info is not None
    names = {p.name for p in info.processes}
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "prometheus"} <= names
    ours = {port for p in info.processes for port in p.ports}
    assert ours <= processes.listening_ports(), "a recorded port was not listening while up"

    # A running pod process: down must end it too (through the node agent).
    pod_pid = None
    if "nodeagent" in names:
        pod_pid = _start_sleeping_pod(info, wait_for)

    stopped = _hack("down", second_cluster)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    for proc in info.processes:
        assert not processes.is_alive(proc), f"{proc.name} pid {proc.pid} still running"
        assert processes.session_members(proc.pid) == [], f"{proc.name} left processes in its session"
    if pod_pid is not None:
        assert not _alive(pod_pid), f"pod process {pod_pid} still running"
    assert not ours & processes.listening_ports(), f"still listening: {sorted(ours & processes.listening_ports())}"
    assert lc.load(second_cluster) is None
    assert (second_cluster / "pki" / "ca.crt").exists(), "down removed more than its process record"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start_sleeping_pod(info: lc.ClusterInfo, wait_for) -> int:
    """Run `sleep` as a pod on the second cluster and return the PID of that process."""
    import secrets

    from kubernetes import client, config

    marker = f"sleeper-{secrets.token_hex(4)}".encode()
    api = client.CoreV1Api(config.new_client_from_config(config_file=str(info.admin_kubeconfig)))
    wait_for(lambda: api.read_namespaced_service_account("default", "default"), timeout=30)
    api.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
        "spec": {"containers": [{"name": "main", "image": "batchtune.test/sleep",
                                 "command": [sys.executable, "-c", "import time; time.sleep(600)", marker.decode()]}]},
    })
    wait_for(lambda: api.read_namespaced_pod("sleeper", "default").status.phase == "Running", timeout=60,
             what="pod sleeper Running")
    sleepers = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _cmdline_has(e, marker)]
    assert sleepers, "no process for pod sleeper"
    return sleepers[0]


def _cmdline_has(entry: Path, marker: bytes) -> bool:
    try:
        return marker in (entry / "cmdline").read_bytes()
    except OSError:
        return False
