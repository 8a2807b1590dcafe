"""Who else manages the target: Argo CD and Flux leave labels and annotations we can read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Markers written by the GitOps controllers themselves onto the objects they apply.
_ARGO_MARKERS = ("argocd.argoproj.io/instance", "argocd.argoproj.io/tracking-id")
_FLUX_MARKERS = (
    "kustomize.toolkit.fluxcd.io/name",
    "helm.toolkit.fluxcd.io/name",
    "kustomize.toolkit.fluxcd.io/namespace",
)


def gitops_manager(obj: Mapping[str, Any]) -> str | None:
    """Returns "Argo CD" or "Flux" when the object carries that controller's markers, else None."""
    meta = obj.get("metadata") or {}
    keys = set((meta.get("labels") or {}).keys()) | set((meta.get("annotations") or {}).keys())
    if any(m in keys for m in _ARGO_MARKERS):
        return "Argo CD"
    if any(m in keys for m in _FLUX_MARKERS):
        return "Flux"
    return None
