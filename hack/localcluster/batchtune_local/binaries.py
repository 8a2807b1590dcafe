"""Where `hack/localcluster/build` puts the pinned binaries, and a clear error when they are missing."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# Keep in step with hack/localcluster/build (the build script reads the same environment variables).
KUBE_VERSION = os.environ.get("KUBE_VERSION", "v1.36.3")
ETCD_VERSION = os.environ.get("ETCD_VERSION", "v3.6.16")
HELM_VERSION = os.environ.get("HELM_VERSION", "v3.22.0")
PROMETHEUS_VERSION = os.environ.get("PROMETHEUS_VERSION", "v0.316.0")
ADAPTER_VERSION = os.environ.get("ADAPTER_VERSION", "v0.12.0")


class MissingBinaries(RuntimeError):
    """A binary the local cluster needs is not built; the message says which and how to build it."""


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHTUNE_CACHE", Path.home() / ".cache" / "batchtune"))


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every program the local cluster runs."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    helm: Path
    prometheus: Path
    openssl: Path


def binaries() -> Binaries:
    """Paths of the built binaries; they may not exist (see `require_binaries`)."""
    kube = cache_dir() / f"kubernetes-{KUBE_VERSION}"
    return Binaries(
        etcd=cache_dir() / f"etcd-{ETCD_VERSION}" / "etcd",
        kube_apiserver=kube / "kube-apiserver",
        kube_controller_manager=kube / "kube-controller-manager",
        kube_scheduler=kube / "kube-scheduler",
        kubectl=kube / "kubectl",
        helm=cache_dir() / f"helm-{HELM_VERSION}" / "helm",
        prometheus=cache_dir() / f"prometheus-{PROMETHEUS_VERSION}" / "prometheus",
        openssl=Path(shutil.which("openssl") or "/usr/bin/openssl"),
    )


def prometheus_adapter() -> Path:
    """prometheus-adapter (custom metrics for an HPA); only the autoscaling test runs it, so it is not in
    `Binaries` (a cluster starts without it). `MissingBinaries` when it is not built."""
    path = cache_dir() / f"prometheus-adapter-{ADAPTER_VERSION}" / "adapter"
    if not os.access(path, os.X_OK):
        raise MissingBinaries(f"prometheus-adapter missing: {path}; run `make setup` (or hack/localcluster/build) to "
                              f"build it into {cache_dir()}")
    return path


def require_binaries() -> Binaries:
    """The binaries, or `MissingBinaries` naming every missing one and the command that builds them."""
    found = binaries()
    missing = [f"{name}={path}" for name, path in vars(found).items() if not os.access(path, os.X_OK)]
    if missing:
        raise MissingBinaries(
            "local cluster binaries missing: " + ", ".join(missing)
            + "; run `make setup` (or hack/localcluster/build) to build them into " + str(cache_dir())
        )
    return found
