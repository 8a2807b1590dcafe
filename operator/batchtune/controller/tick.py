"""One reconcile tick of one BatchTuning: what it knows, and the small steps every phase shares.

A `Tick` holds the object's identity, its parsed spec, the typed status it changes, the ports, the
clock reading, and the Events to post. Phase modules (`planning`, `trialing`, `production`) take a
tick and take the next step; `reconcile` dispatches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from batchtune.api import BatchTuningSpec, BatchTuningStatus
from batchtune.controller import status as status_io
from batchtune.controller.ports import NotAllowed, Ports
from batchtune.controller.prometheus import Production, PrometheusUnavailable, sanitize
from batchtune.core.gitops import ModeDecision, detect, resolve_mode
from batchtune.core.manifests import LABEL_TUNING
from batchtune.core.promql import LabelNames, MetricNames, QueryContext
from batchtune.core.slo import SloTargets
from batchtune.core.vocabulary import ConditionType, Phase, Reason
from batchtune.engines import ENGINES, ArgsError, Engine, UnsafeShell, find_engine_container

Log = logging.Logger | logging.LoggerAdapter[Any]

# Back-off after Prometheus failures, per BatchTuning uid -> (failures, not before). In memory on
# purpose: it only spaces out retries, so losing it on a restart costs one early retry.
PROMETHEUS_BACKOFF: dict[str, tuple[int, datetime]] = {}
MAX_BACKOFF_SECONDS = 60


@dataclass(frozen=True)
class Tuning:
    """The BatchTuning object as a tick sees it."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]


@dataclass(frozen=True)
class Target:
    """Production: its Deployment, the engine it runs and the engine's container."""

    deployment: dict[str, Any]
    engine: Engine
    container: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.deployment["metadata"]["name"])

    @property
    def resource_version(self) -> str:
        return str(self.deployment["metadata"].get("resourceVersion", ""))

    @property
    def pod_spec(self) -> dict[str, Any]:
        return ((self.deployment.get("spec") or {}).get("template") or {}).get("spec") or {}


@dataclass
class Tick:
    tuning: Tuning
    ports: Ports
    now: datetime
    log: Log
    status: BatchTuningStatus = field(init=False)
    spec: BatchTuningSpec | None = None
    _reader: Any = None

    def __post_init__(self) -> None:
        self.status = status_io.load(self.tuning.status)

    # ---- status, conditions, events ---------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.status.phase or Phase.PENDING

    def condition(self, type_: ConditionType, true: bool, reason: Reason, message: str) -> bool:
        return status_io.set_condition(self.status, type_, true, reason.value, message, self.tuning.generation,
                                       self.now)

    def event(self, warning: bool, reason: Reason, message: str) -> None:
        self.ports.cluster.event(self.tuning.namespace, self.tuning.name, self.tuning.uid,
                                 "Warning" if warning else "Normal", reason.value, message[:1000])

    def set_phase(self, phase: Phase, reason: Reason, message: str) -> None:
        self.status.phase = phase
        self.condition(ConditionType.PROGRESSING, not phase.terminal, reason, message)
        if phase in (Phase.SUCCEEDED, Phase.RECOMMENDED):
            self.condition(ConditionType.SUCCEEDED, True, reason, message)
            self.condition(ConditionType.FAILED, False, reason, message)
        elif phase in (Phase.FAILED, Phase.ROLLED_BACK):
            self.condition(ConditionType.SUCCEEDED, False, reason, message)
            self.condition(ConditionType.FAILED, True, reason, message)

    def fail(self, reason: Reason, message: str) -> None:
        failed = self.status.condition(ConditionType.FAILED.value)
        if self.phase is not Phase.FAILED or failed is None or failed.reason != reason.value:
            self.event(True, reason, message)
            self.log.warning("Tuning %s failed: %s", self.tuning.name, message)
        self.set_phase(Phase.FAILED, reason, message)

    def waiting(self, reason: Reason, message: str, warn: bool = False) -> None:
        """Progressing, but waiting on something outside the operator; an Event when the reason is new."""
        if self.condition(ConditionType.PROGRESSING, True, reason, message) and warn:
            self.event(True, reason, message)

    # ---- the target ------------------------------------------------------------------------

    def target(self, name: str | None = None) -> Target | None:
        """Production's Deployment and engine container, or None after setting why."""
        assert self.spec is not None
        ref = self.spec.target_ref
        name = name or ref.name
        ns = self.tuning.namespace
        deployment = self.ports.cluster.deployment(ns, name)
        if deployment is None:
            self.waiting(Reason.TARGET_NOT_FOUND, f"Deployment {ns}/{name} (spec.targetRef.name) not found; waiting for it",
                         warn=True)
            return None
        pod_spec = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
        try:
            engine, container = find_engine_container(pod_spec, ref.container_name, self.ports.engines or ENGINES)
        except UnsafeShell as exc:
            self.fail(Reason.UNSUPPORTED_ARGS, f"Deployment {ns}/{name}: {exc}")
            return None
        except ArgsError as exc:
            self.fail(Reason.NO_ENGINE_CONTAINER, f"Deployment {ns}/{name}: {exc}")
            return None
        return Target(deployment, engine, container)

    def engine_named(self, name: str | None) -> Engine:
        """The engine status names (the first known one when status predates the field)."""
        engines = self.ports.engines or ENGINES
        return next((e for e in engines if e.name == name), engines[0])

    def production(self, target: Target) -> Production:
        """Production's pods (never our trial pods, even if a selector would match them)."""
        selector = (target.deployment.get("spec") or {}).get("selector") or {}
        pods = self.ports.cluster.production_pods(self.tuning.namespace, selector)
        names = tuple(sorted(str(p["metadata"]["name"]) for p in pods
                             if LABEL_TUNING not in ((p["metadata"].get("labels")) or {})))
        return Production(self.tuning.namespace, names)

    def mode_decision(self, target: Target) -> ModeDecision:
        """The apply mode that runs, and why: spec.apply.mode, what manages the target, spec.apply.git."""
        assert self.spec is not None
        a = self.spec.apply
        found = detect(target.deployment, str(target.container.get("name") or ""),
                       self.ports.install.argocd_instance_labels)
        return resolve_mode(a.mode.value if a.mode else None, a.git is not None, found,
                            [m.value for m in a.auto_under_managers or ()])

    def apply_mode(self, target: Target) -> str:
        """Auto, Recommend or PullRequest (`mode_decision`)."""
        return self.mode_decision(target).mode.value

    # ---- Prometheus ------------------------------------------------------------------------

    def slo(self) -> SloTargets:
        assert self.spec is not None
        return SloTargets.from_spec(self.spec.slo)

    def reader(self, engine: Engine) -> Any:
        """The BatchTuning's Prometheus reader; `NotAllowed` when the install forbids its URL or Secret."""
        if self._reader is None:
            assert self.spec is not None
            prom = self.spec.prometheus
            from batchtune.core.policy import prometheus_url_problem

            problem = prometheus_url_problem(prom.url, self.ports.install.prometheus_urls)
            if problem:
                raise NotAllowed(problem)
            token = None
            if prom.auth_secret_ref is not None:
                token = self.ports.cluster.secret_value(self.tuning.namespace, prom.auth_secret_ref.name,
                                                        prom.auth_secret_ref.key)
            ctx = QueryContext(MetricNames.from_spec(engine.metrics, prom.metric_names),
                               LabelNames.from_spec(prom.labels),
                               LabelNames.from_spec(prom.gpu_labels, with_model=False),
                               self.slo().percentile)
            self._reader = self.ports.metrics.reader(prom.url, token, ctx, engine)
        return self._reader

    def backing_off(self) -> bool:
        backoff = PROMETHEUS_BACKOFF.get(self.tuning.uid)
        return backoff is not None and self.now < backoff[1]

    def prometheus_down(self, exc: PrometheusUnavailable) -> None:
        failures = PROMETHEUS_BACKOFF.get(self.tuning.uid, (0, self.now))[0] + 1
        delay = min(MAX_BACKOFF_SECONDS, 2 ** failures)
        PROMETHEUS_BACKOFF[self.tuning.uid] = (failures, self.now + timedelta(seconds=delay))
        url = sanitize(self.spec.prometheus.url) if self.spec else "?"
        if self.condition(ConditionType.DEGRADED, True, Reason.PROMETHEUS_UNREACHABLE,
                          f"Prometheus at {url} (spec.prometheus.url) did not answer: {sanitize(str(exc))}; "
                          f"no decision is taken on missing data, retrying in {delay}s"):
            self.event(True, Reason.PROMETHEUS_UNREACHABLE, sanitize(str(exc)))

    def prometheus_ok(self) -> None:
        PROMETHEUS_BACKOFF.pop(self.tuning.uid, None)
        degraded = self.status.condition(ConditionType.DEGRADED.value)
        if degraded is not None and degraded.status == "True" and degraded.reason == Reason.PROMETHEUS_UNREACHABLE:
            self.condition(ConditionType.DEGRADED, False, Reason.PROMETHEUS_REACHABLE, "Prometheus answers again")

    def not_allowed(self, exc: NotAllowed) -> None:
        self.fail(Reason.NOT_ALLOWED, str(exc))


def iso(now: datetime) -> str:
    return status_io.now_iso(now)
