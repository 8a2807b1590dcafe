"""The local Kubernetes cluster for tests and the demo: a real control plane on loopback.

Public API (also driven by `hack/localcluster/{up,down,status}` via `python -m batchtune_local`):

- `up(ClusterConfig(...)) -> (ClusterInfo, started)`: start, or reuse the healthy cluster in the state dir.
- `down(state_dir) -> ports_still_listening`: stop exactly the recorded processes, in reverse order.
- `check(info) -> [ComponentHealth]`, `is_healthy(info)`, `load(state_dir) -> ClusterInfo | None`.
- `attach(config)` / `detach(state_dir)`: `up`/`down` shared between concurrent test sessions.
- `make_kubeconfig(info, user, groups=()) -> Path`: a kubeconfig for any identity (client certificate).
- `wait_for(predicate, timeout, interval)`: the polling helper used by `up` and the tests.
- `lanes`: which state directories and pod networks this test session or xdist worker owns.
"""

from __future__ import annotations

from pathlib import Path

from batchtune_local import lanes
from batchtune_local.binaries import MissingBinaries, binaries, require_binaries
from batchtune_local.cluster import (
    ClusterConfig,
    ClusterError,
    ClusterInfo,
    ClusterInUse,
    ComponentHealth,
    attach,
    check,
    default_state_dir,
    detach,
    down,
    is_healthy,
    load,
    up,
)
from batchtune_local.health import Timeout, wait_for


def make_kubeconfig(info: ClusterInfo, user: str, groups: tuple[str, ...] = (), path: Path | None = None) -> Path:
    """Write a kubeconfig authenticating as `user` in `groups` with a certificate signed by the cluster CA.

    The identity has only what RBAC grants it (plus system:authenticated), unless a group says otherwise.
    """
    from batchtune_local import pki

    pki_dir = info.state_dir / "pki"
    cert, key = pki.issue_client_cert(pki_dir, binaries().openssl, user, groups)
    target = path or info.state_dir / f"user-{cert.stem.removeprefix('client-')}.kubeconfig"
    return pki.write_kubeconfig(target, info.api_server, info.ca_file, user, client_cert=cert, client_key=key)


__all__ = [
    "ClusterConfig", "ClusterError", "ClusterInfo", "ClusterInUse", "ComponentHealth", "MissingBinaries", "Timeout",
    "attach", "binaries", "check", "lanes", "default_state_dir", "detach", "down", "is_healthy", "load",
    "make_kubeconfig", "require_binaries", "up", "wait_for",
]
