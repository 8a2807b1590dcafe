"""Selecting: the best setting by the core's rules, the recommendation, and the report."""

from __future__ import annotations

from batchtune.api import ContainerArgs, Knee, Recommendation, Setting
from batchtune.controller import telemetry
from batchtune.controller.prometheus import PrometheusUnavailable
from batchtune.controller.tick import Target, Tick
from batchtune.controller.trials import outcome_of
from batchtune.core.gitops import gitops_manager
from batchtune.core.objective import Objective
from batchtune.core.recommend import recommend, replica_hint
from batchtune.core.selection import CompletedTrial, select_best
from batchtune.core.vocabulary import M, Phase, Reason, TrialState

PEAK_LOOKBACK_SECONDS = 3600


def submit_report(tick: Tick) -> None:
    try:
        tick.ports.reports.submit(tick.tuning.namespace, tick.tuning.name, tick.tuning.uid,
                                  dict(tick.tuning.spec), tick.status.to_wire())
    except Exception as exc:  # noqa: BLE001  # a report is nice to have; the decision must not wait on it
        tick.log.warning("Report for %s not queued: %s", tick.tuning.name, exc)


def production_peak(tick: Tick, target: Target) -> tuple[float | None, str]:
    """Production's observed peak request rate (all replicas together) and where it came from."""
    workload = tick.status.workload
    if workload is not None and workload.source == "production" and workload.peak_requests_per_second:
        return workload.peak_requests_per_second, (f"the busiest {workload.rate_window_seconds or 60}s window of "
                                                   f"the profile's {workload.lookback_seconds}s")
    peak = tick.reader(target.engine).production_peak_rate(tick.production(target), PEAK_LOOKBACK_SECONDS)
    return peak, f"the highest 1-minute rate over the last {PEAK_LOOKBACK_SECONDS}s"


def select(tick: Tick) -> None:
    assert tick.spec is not None
    target = tick.target()
    if target is None:
        return
    objective = Objective(tick.spec.objective.type)
    trials = tick.status.trials
    completed = [CompletedTrial(t.name, t.setting.core(), outcome_of(t, objective)) for t in trials if t.state.finished]
    chosen = select_best(completed, objective, tick.slo())
    for trial in trials:
        verdict = chosen.verdicts.get(trial.name)
        if verdict:
            trial.verdict_reason = verdict[:1000]
    tick.status.knee = Knee(max_num_seqs=chosen.knee.max_num_seqs, reason=chosen.knee.reason) if chosen.knee else None
    started = tick.status.plan.started_at if tick.status.plan else None
    if started:
        telemetry.TUNING_DURATION.observe((tick.now - started).total_seconds())
    best = next((t for t in trials if t.name == chosen.best_trial), None)
    if best is None or chosen.best is None:
        reason = chosen.reason
        if not any(t.state is TrialState.DONE for t in trials):
            reason += ": no trial finished a measurement (see each trial's reason)"
        else:
            reason += ": the SLO (spec.slo) is not met by any setting tried; relax the targets or widen spec.searchSpace"
        submit_report(tick)
        tick.fail(Reason.NO_FEASIBLE_SETTING, reason)
        return
    try:
        peak, peak_source = production_peak(tick, target)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        return
    repeats = [t for t in trials if t.state is TrialState.DONE and t.setting.core() == chosen.best]
    hint = replica_hint(objective, [(t.metrics or {}).get(M.SLO_CAPACITY) for t in repeats], peak, peak_source,
                        tick.spec.slo.headroom_percent)
    extra = tuple(tick.spec.search_space.extra_args or ())
    rec = recommend(target.engine, target.deployment, target.container, chosen.best, extra)
    tick.status.recommendation = Recommendation(
        setting=Setting.of(chosen.best), args=rec.container.flat(), reason=chosen.reason[:2000],
        workload=tick.status.workload.summary if tick.status.workload else None,
        json_patch=rec.json_patch, kustomize_patch=rec.kustomize_patch, helm_values=rec.helm_values,
        replicas_hint=hint.replicas, replicas_basis=hint.basis[:500], container_name=rec.container_name,
        container=ContainerArgs.model_validate(rec.container.to_wire()))
    tick.status.best_trial = best.name
    tick.status.best_setting = chosen.best.label()
    submit_report(tick)
    manager = gitops_manager(target.deployment)
    if tick.apply_mode(target) == "Recommend":
        why = (f"the target is managed by {manager}; set spec.apply.mode: Auto to patch it anyway"
               if manager and not tick.spec.apply.mode else "spec.apply.mode is Recommend")
        message = f"Recommended {chosen.best.label()} ({why}): {chosen.reason}" + _for(tick)
        tick.set_phase(Phase.RECOMMENDED, Reason.RECOMMENDATION_READY, message)
        tick.event(False, Reason.RECOMMENDATION_READY, message)
        return
    tick.set_phase(Phase.APPLYING, Reason.SELECTED, f"Selected {chosen.best.label()}: {chosen.reason}" + _for(tick))


def _for(tick: Tick) -> str:
    """`; for <workload>`: the workload a decision holds for."""
    workload = tick.status.workload
    return f"; for {workload.summary}" if workload is not None and workload.summary else ""
