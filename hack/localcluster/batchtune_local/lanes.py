"""Lanes: test sessions (or pytest-xdist workers) that run side by side, each with clusters of its own.

A lane owns a state directory and a loopback pod network per kind of cluster, so nothing is shared between
lanes: not the API server, not etcd, not the node agent's GPU inventory, not Helm releases or CRDs, not pod
IPs. Ports are always picked free at start. The lane comes from `$BATCHTUNE_LANE` (a worktree or a second
checkout sets it), else from pytest-xdist's `$PYTEST_XDIST_WORKER` (`gw0` is lane 1, `gw1` lane 2, ...),
else it is 0: the classic single cluster in ~/.cache/batchtune/cluster on 127.1.0.0/16.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MAX_LANE = 49
"""Lane numbers 0..49 keep every network below inside 127.0.0.0/8 and apart from each other."""


def lane() -> int:
    """This process's lane; ValueError naming the variable for a value that is not a lane number."""
    raw = os.environ.get("BATCHTUNE_LANE")
    if raw is not None and raw.strip() != "":
        if not raw.strip().isdigit() or not 0 <= int(raw) <= MAX_LANE:
            raise ValueError(f"BATCHTUNE_LANE={raw!r}: expected a whole number 0..{MAX_LANE}")
        return int(raw)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    match = re.fullmatch(r"gw(\d+)", worker)
    if match:
        number = int(match.group(1)) + 1
        if number > MAX_LANE:
            raise ValueError(f"PYTEST_XDIST_WORKER={worker!r}: at most {MAX_LANE} workers have lanes")
        return number
    return 0


def _suffix(number: int) -> str:
    return "" if number == 0 else f"-lane{number}"


def cluster_dir(number: int | None = None) -> Path:
    """The twin cluster's state directory ($BATCHTUNE_CLUSTER_DIR names lane 0's)."""
    number = lane() if number is None else number
    base = Path(os.environ.get("BATCHTUNE_CLUSTER_DIR", Path.home() / ".cache" / "batchtune" / "cluster"))
    return base.with_name(base.name + _suffix(number))


def pod_network(number: int | None = None) -> str | None:
    """The twin cluster's pod network: None (the node agent's 127.1.0.0/16) in lane 0, else 127.(100+L).0.0/16."""
    number = lane() if number is None else number
    return None if number == 0 else f"127.{100 + number}.0.0/16"


def real_cluster_dir(number: int | None = None) -> Path:
    """The real-vLLM cluster's state directory ($BATCHTUNE_REAL_CLUSTER_DIR names lane 0's)."""
    number = lane() if number is None else number
    base = Path(os.environ.get("BATCHTUNE_REAL_CLUSTER_DIR", "/tmp/bt-real-cluster"))
    return base.with_name(base.name + _suffix(number))


def real_pod_network(number: int | None = None) -> str:
    """The real-vLLM cluster's pod network: 127.40.0.0/16 in lane 0, else 127.(150+L).0.0/16."""
    number = lane() if number is None else number
    return "127.40.0.0/16" if number == 0 else f"127.{150 + number}.0.0/16"


def scratch_network(number: int | None = None) -> str:
    """A network for a test's own throwaway cluster or node agent: 127.77.0.0/16 in lane 0, else 127.(200+L)."""
    number = lane() if number is None else number
    return "127.77.0.0/16" if number == 0 else f"127.{200 + number}.0.0/16"
