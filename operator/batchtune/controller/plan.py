"""The Pending/Planning phase (I/O): read production, check the spec against the install, plan (core/planning.py)."""

from __future__ import annotations

from batchtune.admission import Review, review
from batchtune.api import (
    MAX_PRUNED_IN_STATUS,
    Baseline,
    CurveLoadRecord,
    CurveLoadType,
    EngineLimitsRecord,
    PlanRecord,
    PrunedSetting,
    ScrapeIntervalRecord,
    Setting,
    WorkloadRecord,
)
from batchtune.controller import records
from batchtune.controller import tick as tick_
from batchtune.controller.ports import MetricsReader
from batchtune.controller.tick import Target, Tick
from batchtune.core import recommend
from batchtune.core.gpus import GPU_PRODUCT_LABEL
from batchtune.core.measurement import window_too_short
from batchtune.core.planning import EngineLimits, Plan, plan_candidates
from batchtune.core.policy import gpu_minutes_budget
from batchtune.core.production import fingerprint
from batchtune.core.protocol import CurveLoad, production_peak_curve_load
from batchtune.core.recommend import ContainerArgs
from batchtune.core.settings import Setting as CoreSetting
from batchtune.core.vocabulary import Phase, Reason
from batchtune.engines import ArgsError, Invocation
from batchtune.prometheus import PrometheusUnavailable


def spec_review(tick: Tick, target: Target) -> Review:
    """What the engine or the install refuses in the spec (extra args, load image): `batchtune.admission`, which
    `batchtune validate` runs too."""
    return review(target.engine, tick.spec, tick.ports.install, str(target.container.get("image", "")))


def refused(tick: Tick, target: Target) -> bool:
    """Whether the spec or the target is refused (after failing the tuning with why): what the engine or the install
    refuses in the spec, or a command line status cannot keep whole."""
    verdict = spec_review(tick, target)
    if verdict.invalid:
        tick.fail(Reason.INVALID_SPEC, "; ".join(verdict.invalid))
        return True
    if verdict.not_allowed:
        tick.fail(Reason.NOT_ALLOWED, "; ".join(verdict.not_allowed))
        return True
    too_long = command_line_problem(tick, target)
    if too_long:
        tick.fail(Reason.COMMAND_LINE_TOO_LONG, too_long)
        return True
    return False


def command_line_problem(tick: Tick, target: Target) -> str | None:
    """Why status cannot keep production's command line, or the trials' and the recommendation's (production's with
    the widest setting of the search space and spec.searchSpace.extraArgs), whole; None when it can."""
    where = (f"Deployment {tick.tuning.namespace}/{target.name} "
             f"spec.template.spec.containers[{target.container.get('name')}]")
    problem = recommend.command_line_problem(ContainerArgs.of(target.container), where)
    if problem:
        return problem
    space = tick.view.spec.space
    widest = CoreSetting(max(space.max_num_seqs), max(space.gpu_memory_utilization_percent),
                         max(space.max_num_batched_tokens) if space.max_num_batched_tokens else None)
    rewritten = target.engine.rewrite(target.container, widest, tick.spec.search_space.extra_args or ())
    return recommend.command_line_problem(
        ContainerArgs.of(rewritten), f"{where} with the setting {widest.label()} and spec.searchSpace.extraArgs "
                                     "(what a trial and the recommendation run)")


def gpu_product(tick: Tick, target: Target) -> str | None:
    """The GPU production runs on: its nodeSelector's product label, else the label of its pods' nodes."""
    selector = target.pod_spec.get("nodeSelector") or {}
    if GPU_PRODUCT_LABEL in selector:
        return str(selector[GPU_PRODUCT_LABEL])
    cluster = tick.ports.cluster
    pods = cluster.production_pods(tick.tuning.namespace, (target.deployment.get("spec") or {}).get("selector") or {})
    node_names = {p["spec"].get("nodeName") for p in pods if (p.get("spec") or {}).get("nodeName")}
    for node in cluster.nodes() or []:
        if node["metadata"]["name"] in node_names:
            product = (node["metadata"].get("labels") or {}).get(GPU_PRODUCT_LABEL)
            if product:
                return str(product)
    return None


def gpu_model(tick: Tick, reader: MetricsReader, target: Target) -> str | None:
    """The GPU model dcgm-exporter reports for production's pods: for the twin where nodes cannot be read.

    Only the memory prefilter uses it; trial pods are never pinned by it (nodes may lack that label).
    """
    try:
        return reader.production_gpu_model(tick.production(target))
    except PrometheusUnavailable:
        return None  # the prefilter is skipped, with its note; planning does not wait on it


def measure_workload(tick: Tick, target: Target) -> WorkloadRecord | None:
    """The workload this round holds for; None (after saying why) while production's cannot be measured yet."""
    if not tick.spec.load.from_production:
        return records.spec_workload(tick.spec.load)
    try:
        profile = tick.production_profile(target)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        return None
    if isinstance(profile, str):
        tick.status.phase = Phase.PLANNING
        tick.waiting(Reason.WAITING_FOR_PRODUCTION_DATA,
                     f"spec.load.fromProduction: {profile}; waiting for traffic (spec.load.production.lookbackSeconds "
                     f"{tick.spec.load.production.lookback_seconds}, minRequests "
                     f"{tick.spec.load.production.min_requests}), or unset fromProduction", warn=True)
        return None
    return profile


def curve_load(tick: Tick, target: Target, reader: MetricsReader, largest_seqs: int) -> CurveLoadRecord | None:
    """The common load of the report's curves (spec.report.curveLoad), fixed now so every trial runs the same.
    Raises PrometheusUnavailable when production's peak cannot be read yet."""
    spec = tick.spec.report.curve_load
    kind = spec.kind
    if kind is CurveLoadType.OFF:
        return None
    if kind is CurveLoadType.REQUESTS_PER_MINUTE:
        assert spec.requests_per_minute is not None
        found = CurveLoad(spec.requests_per_minute, True, "spec.report.curveLoad.requestsPerMinute")
    elif kind is CurveLoadType.CONCURRENCY:
        found = CurveLoad(spec.concurrency, False, "spec.report.curveLoad.concurrency") if spec.concurrency else \
            CurveLoad(largest_seqs, False, f"the largest maxNumSeqs planned ({largest_seqs})")
    else:
        peak = reader.production_peak_rate(tick.production(target), tick_.PEAK_LOOKBACK_SECONDS)
        ready = int((target.deployment.get("status") or {}).get("readyReplicas")
                    or (target.deployment.get("spec") or {}).get("replicas") or 1)
        found = production_peak_curve_load(peak, ready, largest_seqs,
                                           None if tick.spec.load.num_prompts else tick.spec.trial.measure_seconds)
    return CurveLoadRecord(concurrency=None if found.open_loop else found.load,
                           requests_per_minute=found.load if found.open_loop else None, source=found.source[:500])


def window_problem(tick: Tick, target: Target) -> str | None:
    """Why Prometheus could not measure the spec's windows (measure, bracketing, verify), or None."""
    spec, found = tick.spec, tick.scrape_interval()
    interval, source = found.seconds, found.source
    counted = bool(spec.load.num_prompts)
    short = window_too_short(spec.trial.measure_seconds, interval, source=source)
    if short and not counted:
        return f"spec.trial.measureSeconds {spec.trial.measure_seconds}: {short}"
    bracket = spec.trial.bracket_seconds
    short = window_too_short(bracket, interval, "spec.trial.bracketSeconds", source) if bracket else None
    if short and not counted:
        return f"spec.trial.bracketSeconds {bracket}: {short} (or 0: off)"
    short = window_too_short(spec.apply.verify_seconds, interval, "spec.apply.verifySeconds", source)
    if short and tick.apply_mode(target) == "Auto":
        return f"spec.apply.verifySeconds {spec.apply.verify_seconds}: {short}"
    return None


def budget_spent(tick: Tick) -> bool:
    """Whether the BatchTuning's GPU budget is spent (every generation and round counts): then it fails before it
    plans, looks up the target or starts a trial."""
    budget = gpu_minutes_budget(tick.view.spec.strategy.max_gpu_minutes, tick.ports.install.max_gpu_minutes)
    spent = records.gpu_minutes_spent(tick.status, tick.now)
    if spent < budget:
        return False
    tick.fail(Reason.GPU_BUDGET_EXHAUSTED, f"this BatchTuning's trials have held {spent:g} GPU-minutes over all its "
                                           f"generations and rounds, its budget is {budget} (spec.strategy."
                                           "maxGpuMinutes, capped by the install's maxGpuMinutesPerTuning): no "
                                           "new trial starts")
    return True


def plan(tick: Tick) -> None:
    from batchtune.twin.prefilter import memory_fit

    if budget_spent(tick):
        return
    target = tick.target()
    if target is None:
        return
    if tick.devices(target) is None:
        return
    engine = target.engine
    try:
        baseline = engine.read(target.container)
    except ArgsError as exc:
        tick.fail(Reason.UNSUPPORTED_ARGS, f"Deployment {tick.tuning.namespace}/{target.name}: {exc}")
        return
    tick.mode_decision(target)  # the mode in effect shows in status from planning on
    if refused(tick, target):
        return
    try:
        reader = tick.reader(engine)
        reader.ping()
        tick.discover_scrape_interval(target)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        tick.status.phase = Phase.PLANNING
        return
    tick.prometheus_ok()
    short = window_problem(tick, target)
    if short:
        tick.fail(Reason.MEASUREMENT_WINDOW_TOO_SHORT, short)
        return
    workload = measure_workload(tick, target)
    if workload is None:
        return
    product = gpu_product(tick, target)
    fits, note = memory_fit(engine, baseline, product or gpu_model(tick, reader, target))
    # Extra args come last on every trial's command line: their limits (--max-model-len, ...) win.
    limits = engine.limits(baseline.flags, tick.spec.search_space.extra_args or ())
    candidates = plan_candidates(tick.view.spec.space, lambda s: engine.invariant_violation(s, limits), fits, limits)
    tick.status.pruned = [PrunedSetting(setting=Setting.of(p.setting), reason=p.reason, message=p.message[:1000],
                                        memory_reason=p.memory_reason)
                          for p in candidates.pruned[:MAX_PRUNED_IN_STATUS]]
    if not candidates.candidates:
        tick.fail(Reason.EMPTY_SEARCH_SPACE, "No setting is left to try: " + (candidates.error or ""))
        return
    try:
        curve = curve_load(tick, target, reader, max(s.max_num_seqs for s in candidates.candidates))
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        tick.status.phase = Phase.PLANNING
        return
    record_plan(tick, target, baseline, limits, candidates, product, note, curve, workload)


def owned_note(tick: Tick, target: Target) -> list[str]:
    """A heads-up in the plan when the tuning will end in a recommendation whatever spec.apply.mode says."""
    mode = tick.mode_decision(target)
    return [f"Will recommend only: {mode.why}"[:1000]] if mode.forced else []


def record_plan(tick: Tick, target: Target, baseline: Invocation, limits: EngineLimits, candidates: Plan,
                product: str | None, note: str, curve: CurveLoadRecord | None, workload: WorkloadRecord) -> None:
    """The plan into status, and on to Trialing."""
    interval = tick.scrape_interval()
    # A retune round measures production's own setting first, beside the candidates.
    planned = min(tick.spec.strategy.max_trials, len(candidates.candidates)) + (1 if (tick.status.round or 1) > 1 else 0)
    tick.status.baseline = Baseline(
        engine=target.engine.name, container_name=str(target.container["name"]), max_num_seqs=baseline.max_num_seqs,
        gpu_memory_utilization_percent=baseline.gpu_memory_utilization_percent,
        max_num_batched_tokens=baseline.max_num_batched_tokens, args=list(baseline.argv),
        fingerprint=fingerprint(target.container))
    tick.status.plan = PlanRecord(
        gpu_product=product, model=baseline.model, served_model=baseline.served_model or baseline.model,
        engine_limits=EngineLimitsRecord(max_model_len=limits.max_model_len, chunked_prefill=limits.chunked_prefill,
                                         max_num_batched_tokens=limits.max_num_batched_tokens),
        candidates=len(candidates.candidates), notes=[note, *owned_note(tick, target), *candidates.notes][:20],
        started_at=tick.now,
        curve_load=curve, scrape_interval=ScrapeIntervalRecord(seconds=interval.seconds, source=interval.source[:500]))
    tick.status.workload = workload
    tick.status.trials_planned = planned
    tick.status.trials_completed = 0
    devices = tick.devices(target)
    each = f"{devices.count} {devices.resource} each" if devices and devices.count else "no accelerator"
    message = (f"{planned} trials planned from {len(candidates.candidates)} candidates "
               f"({len(candidates.pruned)} pruned), {each}")
    tick.set_phase(Phase.TRIALING, Reason.PLANNED, message)
    tick.event(False, Reason.PLANNED, message)
