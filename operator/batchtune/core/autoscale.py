"""The measured SLO capacity handed to an autoscaler: an HPA (through a custom-metrics adapter) or a KEDA ScaledObject.

The target is the chosen setting's SLO capacity per replica: requests per second one replica served
at the highest load that met every SLO target *tightened by the SLO's headroom* (the trials measure
under `limit x (1 - headroomPercent/100)`), the worst repeat. So the headroom the SLO asked for is in
the target already and is not taken off again. Both manifests scale on vLLM's own load signal, the
rate of finished requests per replica (`vllm:request_success_total`), which is what the capacity
counts: below the target the replicas hold the SLO with headroom to spare; above it, one more
replica is added.

For the HPA, a custom-metrics adapter turns that counter into the per-pod metric
`vllm_requests_per_second` (`ADAPTER_RULE`, prometheus-adapter's rule format); KEDA queries
Prometheus itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from batchtune.core.settings import Setting

HPA_METRIC = "vllm_requests_per_second"
RATE_WINDOW = "1m"


def adapter_rule(counter: str = "vllm:request_success_total", namespace_label: str = "namespace",
                 pod_label: str = "pod") -> dict[str, Any]:
    """prometheus-adapter's rule exposing `HPA_METRIC` per pod from vLLM's finished-requests counter."""
    return {
        "seriesQuery": f'{counter}{{{namespace_label}!="",{pod_label}!=""}}',
        "resources": {"overrides": {namespace_label: {"resource": "namespace"}, pod_label: {"resource": "pod"}}},
        "name": {"matches": f"^{counter}$", "as": HPA_METRIC},
        "metricsQuery": f"sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) by (<<.GroupBy>>)",
    }


@dataclass(frozen=True)
class Capacity:
    """What the tuning measured, as an autoscaler needs it."""

    namespace: str
    deployment: str
    requests_per_second: float
    """The chosen setting's SLO capacity per replica (headroom included)."""
    setting: str
    headroom_percent: int
    replicas_hint: int | None = None


class NoCapacity(ValueError):
    """The tuning measured no SLO capacity to scale on (names why)."""


def _quantity(value: float) -> str:
    """A Kubernetes quantity in milli-units, rounded down (the target never exceeds what was measured)."""
    return f"{max(1, math.floor(value * 1000))}m"


def _bounds(cap: Capacity, min_replicas: int | None, max_replicas: int | None) -> tuple[int, int]:
    low = min_replicas if min_replicas is not None else 1
    high = max_replicas if max_replicas is not None else max(2, low, 2 * (cap.replicas_hint or 1))
    if low < 1 or high < low:
        raise ValueError(f"replicas must satisfy 1 <= min ({low}) <= max ({high})")
    return low, high


def _why(cap: Capacity) -> str:
    return (f"{cap.requests_per_second:.3g} requests/s per replica: the SLO capacity batchtune measured for "
            f"{cap.setting} (SLO targets tightened by {cap.headroom_percent}% headroom)")


def hpa(cap: Capacity, min_replicas: int | None = None, max_replicas: int | None = None,
        scale_down_seconds: int = 300) -> dict[str, Any]:
    low, high = _bounds(cap, min_replicas, max_replicas)
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": cap.deployment, "namespace": cap.namespace,
                     "annotations": {"batchtune.io/target": _why(cap)}},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": cap.deployment},
            "minReplicas": low, "maxReplicas": high,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": HPA_METRIC},
                "target": {"type": "AverageValue", "averageValue": _quantity(cap.requests_per_second)}}}],
            "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                         "scaleDown": {"stabilizationWindowSeconds": scale_down_seconds}},
        },
    }


def production_query(cap: Capacity, counter: str = "vllm:request_success_total", namespace_label: str = "namespace",
                     pod_label: str = "pod") -> str:
    """Production's finished requests per second, all replicas together (its pods only: <deployment>-<rs>-<id>)."""
    return (f'sum(rate({counter}{{{namespace_label}="{cap.namespace}",{pod_label}=~"{cap.deployment}-[a-z0-9]+-[a-z0-9]+"}}'
            f"[{RATE_WINDOW}]))")


def keda(cap: Capacity, prometheus_url: str, min_replicas: int | None = None, max_replicas: int | None = None,
         counter: str = "vllm:request_success_total", namespace_label: str = "namespace",
         pod_label: str = "pod") -> dict[str, Any]:
    low, high = _bounds(cap, min_replicas, max_replicas)
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": cap.deployment, "namespace": cap.namespace,
                     "annotations": {"batchtune.io/target": _why(cap)}},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": cap.deployment},
            "minReplicaCount": low, "maxReplicaCount": high,
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": prometheus_url,
                "query": production_query(cap, counter, namespace_label, pod_label),
                "threshold": f"{math.floor(cap.requests_per_second * 1000) / 1000:g}"}}],
        },
    }


def render(manifest: dict[str, Any], header: str) -> str:
    return "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(manifest, sort_keys=False)


@dataclass(frozen=True)
class Measured:
    """One trial as the capacity reads it: its setting, whether it finished measuring, its SLO capacity."""

    setting: Setting
    done: bool
    slo_capacity: float | None


def capacity(tuning: str, namespace: str, deployment: str, chosen: Setting | None, trials: Sequence[Measured],
             headroom_percent: int, replicas_hint: int | None = None) -> Capacity:
    """The capacity a tuning measured for its chosen setting: the worst of the finished trials at that setting, each
    of which must have measured it; `NoCapacity` (naming `tuning`, "namespace/name") otherwise."""
    if chosen is None:
        raise NoCapacity(f"BatchTuning {tuning} has no recommendation yet")
    values = [t.slo_capacity for t in trials if t.done and t.setting == chosen]
    known = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not known or len(known) < len(values):
        raise NoCapacity(f"BatchTuning {tuning}: the chosen setting's SLO capacity was not measured in every repeat "
                         "(only SloCapacity and Goodput objectives measure it)")
    return Capacity(namespace, deployment, min(known), chosen.label(), headroom_percent, replicas_hint)
