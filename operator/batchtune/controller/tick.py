"""One reconcile tick of one BatchTuning: what it knows, and the small steps every phase shares.

A `Tick` holds the object's identity, its parsed spec and the view of it in core types (`view`, built once per
tick), the typed status it changes, the ports, the clock reading, and the Events to post. Phase modules (`plan`,
`trials`, `decide`, `apply`) take a tick and take the next step; `reconcile` dispatches. No phase module imports
another: what two phases share is here or in `records` (status <-> core).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from batchtune.admission import numerics_message, numerics_unconfirmed
from batchtune.api import AppliedRecord, ApplyMode, BatchTuningSpec, BatchTuningStatus, TrialRecord, WorkloadRecord
from batchtune.api import ContainerArgs as ArgsRecord
from batchtune.controller import records, telemetry
from batchtune.controller import status as status_io
from batchtune.controller.ports import MetricsReader, NotAllowed, Ports
from batchtune.core import ownership, scrape
from batchtune.core.gitops import Mode, ModeDecision, detect, resolve_mode
from batchtune.core.gpus import TrialDevices, trial_devices
from batchtune.core.manifests import LABEL_TUNING
from batchtune.core.policy import prometheus_url_check
from batchtune.core.promql import QueryContext, rate_window_seconds
from batchtune.core.recommend import ContainerArgs, production_args, unmeasured
from batchtune.core.scrape import ScrapeInterval
from batchtune.core.tuning import View, view_of
from batchtune.core.vocabulary import ConditionType, Phase, Reason, TrialState, Verdict
from batchtune.core.workload import build_profile
from batchtune.engines import ENGINES, ArgsError, Engine, UnsafeShell, find_engine_container
from batchtune.prometheus import Production, PrometheusUnavailable, sanitize

Log = logging.Logger | logging.LoggerAdapter[Any]

# Back-off after Prometheus failures, per BatchTuning uid -> (failures, not before). In memory on
# purpose: it only spaces out retries, so losing it on a restart costs one early retry.
PROMETHEUS_BACKOFF: dict[str, tuple[int, datetime]] = {}
MAX_BACKOFF_SECONDS = 60
PEAK_LOOKBACK_SECONDS = 3600
"""Production's peak request rate is the highest 1-minute rate over this lookback."""


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
    _spec: BatchTuningSpec | None = None
    _view: tuple[WorkloadRecord | None, View, float] | None = None
    _reader: MetricsReader | None = None
    _scrape: ScrapeInterval | None = None

    status_problem: str | None = field(init=False, default=None)
    """Why the status as read could not be used (each field and value); then the tick started from a fresh one."""
    wake_at: datetime | None = field(init=False, default=None)
    """The earliest moment a step this tick waited for becomes possible (a finished load run's window complete in
    Prometheus): the timer runs the tuning again then rather than a whole tick later (`handlers.tick`)."""

    load_run_going: bool = field(init=False, default=False)
    """A load run this tick read was still going: its end, as the Job watch sees it, can wake the timer sooner than
    its next run (`handlers.tick`)."""

    def __post_init__(self) -> None:
        self.status, self.status_problem = status_io.read(self.tuning.status)

    def wake(self, at: datetime) -> None:
        """Ask to be run again at `at` (the earliest of every such ask in this tick counts)."""
        self.wake_at = at if self.wake_at is None else min(self.wake_at, at)

    # ---- the spec ------------------------------------------------------------------------------

    @property
    def spec(self) -> BatchTuningSpec:
        """The parsed spec (every phase runs after reconcile parsed it)."""
        if self._spec is None:
            raise RuntimeError(f"BatchTuning {self.tuning.name}: the spec is read before it was parsed")
        return self._spec

    @spec.setter
    def spec(self, spec: BatchTuningSpec) -> None:
        self._spec, self._view = spec, None

    @property
    def parsed(self) -> bool:
        return self._spec is not None

    @property
    def view(self) -> View:
        """The spec in core types and what derives from it, built once per tick (again only when planning records a
        new workload)."""
        workload = self.status.workload
        interval = self.scrape_interval().seconds
        if self._view is None or self._view[0] is not workload or self._view[2] != interval:
            profile = workload.profile() if workload is not None else None
            built = view_of(self.spec.core(), interval, profile, workload.input_tokens if workload else None,
                            workload.output_tokens if workload else None)
            self._view = (workload, built, interval)
        return self._view[1]

    # ---- the scrape interval ----------------------------------------------------------------

    def scrape_interval(self) -> ScrapeInterval:
        """The scrape interval this tuning's windows are held to (`core.scrape`): the install's override, else
        what this tick found out (planning), else what planning recorded in status, else 15 s, said to be assumed."""
        override = self.ports.install.scrape_interval_seconds
        if override:
            return ScrapeInterval(override, scrape.OVERRIDE_SOURCE)
        if self._scrape is not None:
            return self._scrape
        recorded = self.status.plan.scrape_interval if self.status.plan else None
        if recorded is not None:
            return ScrapeInterval(recorded.seconds, recorded.source)
        return scrape.assumed("planning recorded none (status from an older operator)")

    def discover_scrape_interval(self, target: Target) -> ScrapeInterval:
        """Ask the tuning's Prometheus how often it scrapes the target's pods (planning); the install's override
        wins. `PrometheusUnavailable` propagates; a Prometheus that does not say gives the assumed 15 s."""
        if self.ports.install.scrape_interval_seconds:
            return self.scrape_interval()
        found = self.reader(target.engine).scrape_interval(self.production(target),
                                                           f"Deployment {self.tuning.namespace}/{target.name}")
        self._scrape = found or scrape.assumed("Prometheus reported neither its targets' scrape intervals nor "
                                               "its configuration")
        return self._scrape

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
        ref = self.spec.target_ref
        name = name or ref.name
        ns = self.tuning.namespace
        deployment = self.ports.cluster.deployment(ns, name)
        if deployment is None:
            self.target_missing(f"Deployment {ns}/{name} (spec.targetRef.name)")
            return None
        self.status.target_missing_since = None
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

    def target_missing(self, what: str) -> None:
        """Wait for a missing target, up to spec.trial.readinessTimeoutSeconds from when it went missing: then the
        tuning fails and its unfinished trials are finished, so the garbage pass frees their GPUs."""
        since = self.status.target_missing_since or self.now
        self.status.target_missing_since = since
        timeout = self.spec.trial.readiness_timeout_seconds
        if self.now - since < timedelta(seconds=timeout):
            self.waiting(Reason.TARGET_NOT_FOUND, f"{what} not found; waiting for it until "
                                                  f"{iso(since + timedelta(seconds=timeout))}", warn=True)
            return
        message = (f"{what} has been missing since {iso(since)}, longer than spec.trial.readinessTimeoutSeconds "
                   f"({timeout}s); the tuning stopped and its trials' GPUs were freed")
        for trial in self.status.trials:
            if not trial.state.finished:
                self.finish(trial, TrialState.FAILED, Reason.TARGET_NOT_FOUND, message, Verdict.UNKNOWN)
        self.fail(Reason.TARGET_NOT_FOUND, message)

    def devices(self, target: Target) -> TrialDevices | None:
        """The accelerator each trial takes (`core.gpus.trial_devices`), or None after failing the tuning with
        the reason that names the resource batchtune cannot count."""
        found = trial_devices(target.pod_spec, f"Deployment {self.tuning.namespace}/{target.name} spec.template.spec")
        if isinstance(found, str):
            self.fail(Reason.UNCOUNTED_ACCELERATOR, found)
            return None
        return found

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
        """The apply mode that runs, and why: never Auto on a target a controller owns (`core.ownership`); else
        spec.apply.mode, what manages the target, spec.apply.git (`core.gitops.resolve_mode`)."""
        a = self.spec.apply
        spec_mode = a.mode.value if a.mode else None
        found = detect(target.deployment, str(target.container.get("name") or ""),
                       self.ports.install.argocd_instance_labels)
        owned = ownership.apply_mode(spec_mode, target.deployment)
        if owned.forced:
            decision = ModeDecision(Mode.RECOMMEND, owned.why, detection=found, forced=True)
        else:
            decision = resolve_mode(spec_mode, a.git is not None, found, [m.value for m in a.auto_under_managers or ()])
            unconfirmed = numerics_unconfirmed(target.engine, self.spec)
            if decision.mode is Mode.AUTO and unconfirmed:  # a person decides on a change to what production outputs
                fallback = Mode.PULL_REQUEST if a.git is not None else Mode.RECOMMEND
                decision = ModeDecision(fallback, numerics_message(unconfirmed), downgraded=True, detection=found)
        self.status.mode = ApplyMode(decision.mode.value)  # the mode in effect, for status and `kubectl get bt`
        return decision

    def apply_mode(self, target: Target) -> str:
        """Auto, Recommend or PullRequest (`mode_decision`)."""
        return self.mode_decision(target).mode.value

    # ---- trials ----------------------------------------------------------------------------

    def finish(self, trial: TrialRecord, state: TrialState, reason: Reason, message: str, verdict: Verdict,
               verdict_reason: str | None = None) -> None:
        """The trial's outcome, in status; its objects are deleted once status says so (the garbage pass)."""
        trial.state = state
        trial.reason = reason
        trial.message = message[:500]
        trial.verdict = verdict
        trial.verdict_reason = (verdict_reason or message)[:500]
        trial.finished_at = self.now
        records.compact(trial)
        telemetry.TRIALS.labels(result=state.value).inc()
        self.log.info("Finished trial %s: %s (%s)", trial.name, state.value, reason.value)

    def target_changed(self, target: Target) -> None:
        """Production's container changed under the tuning: the measurements no longer hold, plan again."""
        message = (f"Deployment {self.tuning.namespace}/{target.name} changed its engine container (image, command, "
                   "args, env or resources) during tuning; the trials measured the old one, so tuning starts over")
        for trial in self.status.trials:
            if not trial.state.finished:
                self.finish(trial, TrialState.FAILED, Reason.TARGET_CHANGED, message, Verdict.UNKNOWN)
        self.status.gpu_minutes_carried = records.gpu_minutes_spent(self.status, self.now)  # the budget keeps them
        self.status.trials = []
        self.status.pruned = []
        self.status.plan = None
        self.status.baseline = None
        self.status.trials_planned = 0
        self.status.trials_completed = 0
        self.set_phase(Phase.PENDING, Reason.TARGET_CHANGED, message)
        self.event(True, Reason.TARGET_CHANGED, message)

    # ---- production, through Prometheus ---------------------------------------------------------

    def production_profile(self, target: Target) -> WorkloadRecord | str:
        """Production's measured workload, or why there is none (`PrometheusUnavailable` propagates)."""
        wanted = self.spec.load.production
        lookback = wanted.lookback_seconds
        window = min(rate_window_seconds(self.scrape_interval().seconds), lookback)
        observation = self.reader(target.engine).production_workload(self.production(target), lookback, window)
        if observation is None:
            return f"Deployment {self.tuning.namespace}/{target.name} has no pods to measure"
        result = build_profile(observation, wanted.min_requests)
        if result.profile is None:
            return result.problem or "no profile"
        return WorkloadRecord.of(result.profile, self.now)

    def args_change(self, target: Target) -> tuple[ContainerArgs, ContainerArgs] | None:
        """(production's args, its args with the recommendation), or None when production already runs the
        recommendation (then Succeeded, AlreadyOptimal) or it is no measured point of the search space (then Failed,
        UnmeasuredRecommendation): the step Auto (apply) and PullRequest (gitdelivery) share."""
        assert self.status.recommendation is not None
        setting = self.status.recommendation.setting.core()
        problem = unmeasured(setting, self.view.spec.space,
                             (t.setting.core() for t in self.status.trials if t.state is TrialState.DONE))
        if problem is not None:
            self.fail(Reason.UNMEASURED_RECOMMENDATION, f"Production was not changed: {problem} "
                                                        "(status.recommendation is not evidence)")
            return None
        desired = production_args(target.engine, target.container, setting, self.view.spec.extra_args)
        current = ContainerArgs.of(target.container)
        if current == desired:
            self.set_phase(Phase.SUCCEEDED, Reason.ALREADY_OPTIMAL, "Production already runs the chosen setting")
            return None
        return current, desired

    def checkpointed(self, target: Target, current: ContainerArgs, desired: ContainerArgs) -> bool:
        """Whether status.applied holds production's window and exact args from before the change (what verify
        compares against). If not, they are read and recorded now and this tick's step ends (False); so does an
        unreachable Prometheus."""
        applied = self.status.applied
        if applied is not None and applied.before is not None and applied.previous is not None and \
                applied.previous.core() == current:
            return True
        since = self.now - timedelta(seconds=max(60, self.spec.apply.verify_seconds))
        try:
            before = self.reader(target.engine).production_window(self.production(target), since, self.now)
        except PrometheusUnavailable as exc:
            self.prometheus_down(exc)
            return False
        self.status.applied = AppliedRecord(generation=self.tuning.generation, target=target.name,
                                            previous=ArgsRecord.of(current), new=ArgsRecord.of(desired),
                                            before={k: v for k, v in before.items() if v is not None})
        return False

    def production_peak(self, target: Target) -> tuple[float | None, str]:
        """Production's observed peak request rate (all replicas together) and where it came from
        (`PrometheusUnavailable` propagates)."""
        workload = self.status.workload
        if workload is not None and workload.source == "production" and workload.peak_requests_per_second:
            return workload.peak_requests_per_second, (f"the busiest {workload.rate_window_seconds or 60}s window of "
                                                       f"the profile's {workload.lookback_seconds}s")
        peak = self.reader(target.engine).production_peak_rate(self.production(target), PEAK_LOOKBACK_SECONDS)
        return peak, f"the highest 1-minute rate over the last {PEAK_LOOKBACK_SECONDS}s"

    # ---- Prometheus ------------------------------------------------------------------------

    def reader(self, engine: Engine) -> MetricsReader:
        """The BatchTuning's Prometheus reader; `NotAllowed` when the install forbids its URL or Secret."""
        if self._reader is None:
            prom = self.spec.prometheus
            checked = prometheus_url_check(prom.url, self.ports.install.prometheus_urls)
            if checked.problem:
                raise NotAllowed(checked.problem)
            token = None
            if prom.auth_secret_ref is not None:
                token = self.ports.cluster.secret_value(self.tuning.namespace, prom.auth_secret_ref.name,
                                                        prom.auth_secret_ref.key)
            ctx = QueryContext(prom.metric_names.core(engine.metrics), prom.labels.core(), prom.gpu_labels.core(),
                               self.view.slo.percentile)
            self._reader = self.ports.metrics.reader(checked, token, ctx, engine, self.tuning.uid)
        return self._reader

    def backing_off(self) -> bool:
        backoff = PROMETHEUS_BACKOFF.get(self.tuning.uid)
        return backoff is not None and self.now < backoff[1]

    def prometheus_down(self, exc: PrometheusUnavailable) -> None:
        failures = PROMETHEUS_BACKOFF.get(self.tuning.uid, (0, self.now))[0] + 1
        delay = min(MAX_BACKOFF_SECONDS, 2 ** failures)
        PROMETHEUS_BACKOFF[self.tuning.uid] = (failures, self.now + timedelta(seconds=delay))
        url = sanitize(self.spec.prometheus.url) if self.parsed else "?"
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
