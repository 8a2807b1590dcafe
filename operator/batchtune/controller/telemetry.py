"""The operator's own metrics (prometheus-client), served on --metrics-port."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from batchtune.controller import records
from batchtune.core.autoscale import NoCapacity

if TYPE_CHECKING:
    from batchtune.api import BatchTuningSpec, BatchTuningStatus

TRIALS = Counter("batchtune_trials_total", "Trials finished, by result.", ["result"])
TUNING_DURATION = Histogram(
    "batchtune_tuning_duration_seconds", "Wall time from the first trial to the decision.",
    buckets=(60, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400),
)
PROMETHEUS_ERRORS = Counter("batchtune_prometheus_query_errors_total", "Prometheus queries that failed.")
PROMETHEUS_QUERIES = Counter("batchtune_prometheus_queries_total", "Prometheus queries sent (including failed ones).")
RECONCILE_SECONDS = Histogram("batchtune_reconcile_seconds", "Time spent in one reconcile step.",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
ROLLBACKS = Counter("batchtune_rollbacks_total", "Production rollbacks after a failed verify.")
LEADER = Gauge("batchtune_leader", "1 while this replica holds the leader Lease and runs the operator, 0 on standby "
               "(1 without --leader-elect).")
LEADER.set(1)
LEADER_TRANSITIONS = Counter("batchtune_leader_acquired_total", "Times this replica took the leader Lease.")
DECISION_LABELS = ["namespace", "batchtuning", "deployment"]
SLO_CAPACITY = Gauge(
    "batchtune_slo_capacity_requests_per_second",
    "The chosen setting's measured SLO capacity per replica: requests per second one replica serves within every SLO "
    "target tightened by the SLO's headroom (the worst repeat). An autoscaler's per-replica target.", DECISION_LABELS)
SETTING = Gauge("batchtune_setting_value", "The chosen setting's knob values (maxNumSeqs, gpuMemoryUtilizationPercent, "
                                           "maxNumBatchedTokens), per tuned Deployment.", [*DECISION_LABELS, "knob"])
SLO_HEADROOM = Gauge("batchtune_slo_headroom_percent", "The SLO headroom the capacity was measured under.",
                     DECISION_LABELS)
_EXPORTED: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}


def export_decision(namespace: str, name: str, spec: BatchTuningSpec | None, status: BatchTuningStatus) -> None:
    """Set the decision gauges from a BatchTuning's status (level-based: every tick; gone knobs are removed).
    `spec` None: a spec this operator cannot read, nothing exported."""
    key = (namespace, name)
    rec = status.recommendation
    if rec is None or spec is None:
        forget(*key)
        return
    deployment = spec.target_ref.name
    if key in _EXPORTED and _EXPORTED[key][0] != deployment:
        forget(*key)
    labels = (namespace, name, deployment)
    knobs = rec.setting.core().to_status()
    for knob in set(_EXPORTED.get(key, ("", ()))[1]) - set(knobs):
        SETTING.remove(*labels, knob)
    for knob, value in knobs.items():
        SETTING.labels(*labels, knob).set(value)
    try:
        cap = records.capacity(namespace, name, spec, status)
        SLO_CAPACITY.labels(*labels).set(cap.requests_per_second)
        SLO_HEADROOM.labels(*labels).set(cap.headroom_percent)
    except NoCapacity:
        for gauge in (SLO_CAPACITY, SLO_HEADROOM):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
    _EXPORTED[key] = (deployment, tuple(knobs))


def forget(namespace: str, name: str) -> None:
    """Drop a BatchTuning's decision gauges (deleted, or no recommendation any more)."""
    deployment, knobs = _EXPORTED.pop((namespace, name), ("", ()))
    if not deployment:
        return
    labels = (namespace, name, deployment)
    for gauge in (SLO_CAPACITY, SLO_HEADROOM):
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
    for knob in knobs:
        with contextlib.suppress(KeyError):
            SETTING.remove(*labels, knob)


def serve(port: int, address: str) -> None:
    start_http_server(port, addr=address)
