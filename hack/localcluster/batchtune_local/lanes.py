"""Lanes: test sessions and pytest-xdist workers that run side by side, each with clusters of its own.

A lane owns a state directory and a loopback pod network per kind of cluster, so nothing is shared between
lanes: not the API server, not etcd, not the node agent's GPU inventory, not Helm releases or CRDs, not pod
IPs (ports are always picked free at start). A lane is two numbers:

- the checkout's lane, `$BATCHTUNE_LANE` (0..49, default 0): a second checkout or worktree sets its own;
- the worker, from pytest-xdist's `$PYTEST_XDIST_WORKER` (`gw0` is worker 1, `gw1` worker 2, ..., up to 15),
  0 outside xdist.

Lane (0, 0) is the classic single cluster: ~/.cache/batchtune/cluster on 127.1.0.0/16, the real-vLLM one in
/tmp/bt-real-cluster on 127.40.0.0/16. Every other lane takes a /20 of its own in 127.100-249.x.x.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MAX_CHECKOUT = 49
MAX_WORKER = 15


@dataclass(frozen=True)
class Lane:
    checkout: int = 0
    worker: int = 0

    @property
    def classic(self) -> bool:
        return self.checkout == 0 and self.worker == 0

    @property
    def suffix(self) -> str:
        """What this lane adds to a state directory's name ('' for the classic lane)."""
        return (f"-lane{self.checkout}" if self.checkout else "") + (f"-w{self.worker}" if self.worker else "")

    def network(self, first_octet: int) -> str:
        """This lane's /20 in 127.(first_octet + checkout).0.0/16."""
        return f"127.{first_octet + self.checkout}.{16 * self.worker}.0/20"


def current() -> Lane:
    """This process's lane; ValueError naming the variable whose value is not a lane."""
    raw = os.environ.get("BATCHTUNE_LANE", "").strip()
    if raw and (not raw.isdigit() or int(raw) > MAX_CHECKOUT):
        raise ValueError(f"BATCHTUNE_LANE={raw!r}: expected a whole number 0..{MAX_CHECKOUT}")
    worker_id = os.environ.get("PYTEST_XDIST_WORKER", "")
    match = re.fullmatch(r"gw(\d+)", worker_id)
    worker = int(match.group(1)) + 1 if match else 0
    if worker > MAX_WORKER:
        raise ValueError(f"PYTEST_XDIST_WORKER={worker_id!r}: at most {MAX_WORKER} workers have lanes")
    return Lane(int(raw or 0), worker)


def cluster_dir(lane: Lane | None = None) -> Path:
    """The twin cluster's state directory ($BATCHTUNE_CLUSTER_DIR names the classic lane's)."""
    lane = lane or current()
    base = Path(os.environ.get("BATCHTUNE_CLUSTER_DIR", Path.home() / ".cache" / "batchtune" / "cluster"))
    return base.with_name(base.name + lane.suffix)


def pod_network(lane: Lane | None = None) -> str | None:
    """The twin cluster's pod network: None (the node agent's own 127.1.0.0/16) in the classic lane."""
    lane = lane or current()
    return None if lane.classic else lane.network(100)


def real_cluster_dir(lane: Lane | None = None) -> Path:
    """The real-vLLM cluster's state directory ($BATCHTUNE_REAL_CLUSTER_DIR names the classic lane's)."""
    lane = lane or current()
    base = Path(os.environ.get("BATCHTUNE_REAL_CLUSTER_DIR", "/tmp/bt-real-cluster"))
    return base.with_name(base.name + lane.suffix)


def real_pod_network(lane: Lane | None = None) -> str:
    """The real-vLLM cluster's pod network: 127.40.0.0/16 in the classic lane."""
    lane = lane or current()
    return "127.40.0.0/16" if lane.classic else lane.network(150)


def scratch_network(lane: Lane | None = None) -> str:
    """A network for a test's own throwaway cluster or node agent: 127.77.0.0/16 in the classic lane."""
    lane = lane or current()
    return "127.77.0.0/16" if lane.classic else lane.network(200)
