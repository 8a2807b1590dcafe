"""GPU accounting: how many more trials fit on the nodes production runs on, per node, honestly.

A trial needs all its GPUs on one node (a 2-GPU tensor-parallel pod cannot straddle two). Pods bound
to a node hold their requests there; pods not yet bound, and trials other BatchTunings have decided
to start but not created yet (their intents), will take GPUs somewhere: they are placed first, largest
first, on the nodes with the least room that fits them (as a scheduler packing GPUs would), so
concurrent tunings queue instead of oversubscribing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class NodeGpus:
    name: str
    allocatable: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.allocatable - self.used)


def container_gpus(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(GPU_RESOURCE)
    try:
        return int(value) if value else 0
    except (TypeError, ValueError):
        return 0


def pod_gpus(pod: Mapping[str, Any]) -> int:
    return sum(container_gpus(c) for c in ((pod.get("spec") or {}).get("containers") or []))


def eligible_nodes(nodes: Iterable[Mapping[str, Any]], selector: Mapping[str, str],
                   product: str | None) -> list[Mapping[str, Any]]:
    """Nodes a trial may land on: matching the target's nodeSelector and production's GPU product."""
    out = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if not all(labels.get(k) == v for k, v in selector.items()):
            continue
        if product is not None and labels.get(GPU_PRODUCT_LABEL) != product:
            continue
        if int(((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0) or 0) <= 0:
            continue
        out.append(node)
    return out


def node_usage(nodes: Sequence[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> tuple[list[NodeGpus], list[int]]:
    """GPUs per eligible node less what bound pods hold, and the GPU demands of pods not yet bound."""
    names = {str(n["metadata"]["name"]) for n in nodes}
    used = {name: 0 for name in names}
    unbound: list[int] = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        gpus = pod_gpus(pod)
        if not gpus:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if node in used:
            used[node] += gpus
        elif not node:
            unbound.append(gpus)
    usage = [NodeGpus(str(n["metadata"]["name"]),
                      int(((n.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0) or 0),
                      used[str(n["metadata"]["name"])]) for n in nodes]
    return usage, unbound


def trials_that_fit(usage: Sequence[NodeGpus], pending: Sequence[int], per_trial: int) -> int:
    """How many more trials of `per_trial` GPUs fit once `pending` demands (unbound pods, intents) are placed."""
    if per_trial <= 0:
        raise ValueError(f"a trial needs at least one GPU to count, not {per_trial!r}")
    free = [n.free for n in usage]
    for demand in sorted(pending, reverse=True):
        fitting = [i for i, f in enumerate(free) if f >= demand]
        if fitting:
            best = min(fitting, key=lambda i: free[i])  # best fit keeps big holes for big pods
            free[best] -= demand
        else:
            # It cannot be placed whole anywhere: it still waits for GPUs, take them from the largest holes.
            for i in sorted(range(len(free)), key=lambda i: -free[i]):
                take = min(free[i], demand)
                free[i] -= take
                demand -= take
                if demand == 0:
                    break
    return sum(f // per_trial for f in free)
