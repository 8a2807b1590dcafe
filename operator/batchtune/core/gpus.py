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
from datetime import datetime
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


ACCELERATOR_DOMAINS = ("nvidia.com/", "amd.com/", "gpu.intel.com/", "habana.ai/", "aws.amazon.com/neuron",
                       "google.com/tpu", "xilinx.com/", "qualcomm.com/")
"""Extended resources that are accelerators: every device plugin resource of these vendors (`nvidia.com/gpu`, MIG
slices `nvidia.com/mig-1g.10gb`, `amd.com/gpu`, ...), each unit one device for the budget and the free-device check."""


def is_accelerator(resource: str) -> bool:
    return resource.startswith(ACCELERATOR_DOMAINS)


@dataclass(frozen=True)
class NodeGpus:
    name: str
    allocatable: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.allocatable - self.used)


def _count(value: Any) -> int:
    try:
        return int(value) if value else 0
    except (TypeError, ValueError):
        return 0


def container_accelerators(container: Mapping[str, Any]) -> dict[str, int]:
    """Accelerator devices one container asks for, by resource (its limit, else its request)."""
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    names = [str(n) for n in {**requests, **limits} if is_accelerator(str(n))]
    counts = {n: _count(limits.get(n) or requests.get(n)) for n in names}
    return {n: c for n, c in counts.items() if c > 0}


def pod_accelerators(pod_spec: Mapping[str, Any]) -> dict[str, int]:
    """Accelerator devices a pod holds, by resource: its containers' sum, or an init container's if larger (the
    scheduler's effective request)."""
    total: dict[str, int] = {}
    for container in pod_spec.get("containers") or []:
        for name, count in container_accelerators(container).items():
            total[name] = total.get(name, 0) + count
    for container in pod_spec.get("initContainers") or []:
        for name, count in container_accelerators(container).items():
            total[name] = max(total.get(name, 0), count)
    return total


def container_gpus(container: Mapping[str, Any]) -> int:
    """Accelerator devices of every kind one container asks for."""
    return sum(container_accelerators(container).values())


def pod_gpus(pod: Mapping[str, Any], resource: str | None = None) -> int:
    """Accelerator devices a pod holds: of one resource, or of every kind (None)."""
    held = pod_accelerators(pod.get("spec") or {})
    return sum(held.values()) if resource is None else held.get(resource, 0)


@dataclass(frozen=True)
class TrialDevices:
    """What one trial holds: `count` devices of one accelerator resource (each counts in GPU-minutes)."""

    resource: str
    count: int


def trial_devices(pod_spec: Mapping[str, Any], where: str) -> TrialDevices | str:
    """The accelerator a trial cloned from this pod template takes, or why batchtune refuses to count it: a DRA
    ResourceClaim (the devices it allocates are not in the pod spec), or devices of two kinds (a trial's fit on one
    node is checked for one resource). `where` names the pod template in the message."""
    for i, claim in enumerate(pod_spec.get("resourceClaims") or []):
        name = (claim or {}).get("name") if isinstance(claim, Mapping) else None
        return (f"{where}.resourceClaims[{i}] ({name!r}) is a DRA ResourceClaim: batchtune cannot count the devices "
                "it allocates against the GPU budget or the free-GPU check, so it refuses the target; request "
                "accelerators as extended resources (nvidia.com/gpu, nvidia.com/mig-*, amd.com/gpu) instead")
    for kind in ("initContainers", "containers"):
        for i, container in enumerate(pod_spec.get(kind) or []):
            claims = ((container or {}).get("resources") or {}).get("claims") or []
            if claims:
                first = claims[0].get("name") if isinstance(claims[0], Mapping) else claims[0]
                return (f"{where}.{kind}[{i}].resources.claims ({first!r}) uses a DRA ResourceClaim: batchtune "
                        "cannot count the devices it allocates against the GPU budget or the free-GPU check, so it "
                        "refuses the target")
    held = pod_accelerators(pod_spec)
    if len(held) > 1:
        return (f"{where} asks for accelerators of {len(held)} kinds ({', '.join(sorted(held))}): batchtune counts a "
                "trial's devices of one resource only, so it refuses the target")
    if not held:
        return TrialDevices(GPU_RESOURCE, 0)
    (resource, count), = held.items()
    return TrialDevices(resource, count)


def held_minutes(spans: Iterable[tuple[int, datetime | None, datetime | None]], now: datetime) -> float:
    """Device-minutes held by trials given as (devices, started, finished or None while running)."""
    total = 0.0
    for devices, started, finished in spans:
        if started is None or not devices:
            continue
        total += devices * max(0.0, ((finished or now) - started).total_seconds()) / 60
    return round(total, 2)


def eligible_nodes(nodes: Iterable[Mapping[str, Any]], selector: Mapping[str, str],
                   product: str | None, resource: str = GPU_RESOURCE) -> list[Mapping[str, Any]]:
    """Nodes a trial may land on: matching the target's nodeSelector and production's GPU product, with `resource`."""
    out = []
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if not all(labels.get(k) == v for k, v in selector.items()):
            continue
        if product is not None and labels.get(GPU_PRODUCT_LABEL) != product:
            continue
        if _count(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0)) <= 0:
            continue
        out.append(node)
    return out


def node_usage(nodes: Sequence[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
               resource: str = GPU_RESOURCE) -> tuple[list[NodeGpus], list[int]]:
    """Devices of `resource` per eligible node less what bound pods hold, and the demands of pods not yet bound."""
    names = {str(n["metadata"]["name"]) for n in nodes}
    used = {name: 0 for name in names}
    unbound: list[int] = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        gpus = pod_gpus(pod, resource)
        if not gpus:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if node in used:
            used[node] += gpus
        elif not node:
            unbound.append(gpus)
    usage = [NodeGpus(str(n["metadata"]["name"]),
                      _count(((n.get("status") or {}).get("allocatable") or {}).get(resource, 0)),
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
