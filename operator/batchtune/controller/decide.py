"""Selecting: the best setting by the core's rules, the recommendation, and the report."""

from __future__ import annotations

from batchtune.api import ContainerArgs, Knee, Recommendation, Setting, TrialRecord
from batchtune.controller import records, telemetry
from batchtune.controller.tick import Target, Tick
from batchtune.core.gitops import Mode
from batchtune.core.objective import Objective
from batchtune.core.recommend import ContainerArgs as ProductionArgs
from batchtune.core.recommend import kustomize_patch, production_args, recommend, replica_hint
from batchtune.core.retune import RoundVerdict, judge_round
from batchtune.core.selection import OBJECTIVE_WORDS, CompletedTrial, Selection, select_best
from batchtune.core.settings import Setting as CoreSetting
from batchtune.core.slo import evaluate_slo
from batchtune.core.vocabulary import ConditionType, M, Phase, Reason, TrialState, Verdict
from batchtune.prometheus import PrometheusUnavailable


def submit_report(tick: Tick) -> None:
    try:
        tick.ports.reports.submit(tick.tuning.namespace, tick.tuning.name, tick.tuning.uid,
                                  dict(tick.tuning.spec), tick.status.to_wire())
    except Exception as exc:  # noqa: BLE001  # a report is nice to have; the decision must not wait on it
        tick.log.warning("Report for %s not queued: %s", tick.tuning.name, exc)


def select(tick: Tick) -> None:
    target = tick.target()
    if target is None:
        return
    objective = tick.view.objective
    trials = tick.status.trials
    # A retune round's trial 0 ran production's own command line: it is compared with the winner, not a candidate.
    current = next((t for t in trials if t.current), None)
    as_candidate = current is not None and records.current_is_candidate(tick.status, tick.view, target.engine,
                                                                        target.container)
    completed = [CompletedTrial(t.name, t.setting.core(), records.outcome_of(t, objective)) for t in trials
                 if t.state.finished and (as_candidate or not t.current)]
    chosen = select_best(completed, objective, tick.view.slo)
    for trial in trials:
        verdict = chosen.verdicts.get(trial.name)
        if verdict:
            trial.verdict_reason = verdict[:1000]
    tick.status.knee = Knee(max_num_seqs=chosen.knee.max_num_seqs, reason=chosen.knee.reason) if chosen.knee else None
    started = tick.status.plan.started_at if tick.status.plan else None
    if started:
        telemetry.TUNING_DURATION.observe((tick.now - started).total_seconds())
    best = next((t for t in trials if t.name == chosen.best_trial), None)
    judged = None
    if current is not None:
        judged = judge_current(tick, target, objective, chosen, completed, current)
        if not judged.change:
            keep(tick, target, objective, current, judged, chosen.best is None)
            return
    if best is None or chosen.best is None:
        reason = chosen.reason
        if not any(t.state is TrialState.DONE for t in trials):
            reason += ": no trial finished a measurement (see each trial's reason)"
        else:
            reason += ": the SLO (spec.slo) is not met by any setting tried; relax the targets or widen spec.searchSpace"
        tick.fail(Reason.NO_FEASIBLE_SETTING, reason)
        submit_report(tick)
        return
    recommend_best(tick, target, objective, best, chosen.best, as_candidate,
                   chosen.reason if judged is None else f"{chosen.reason}; {judged.message}")


def recommend_best(tick: Tick, target: Target, objective: Objective, best: TrialRecord, setting: CoreSetting,
                   as_candidate: bool, reason: str) -> None:
    """The chosen setting as the recommendation (its replica hint from production's peak), then Recommended or on
    to Applying."""
    try:
        peak, peak_source = tick.production_peak(target)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        return
    repeats = [t for t in tick.status.trials if t.state is TrialState.DONE and t.setting.core() == setting
               and (as_candidate or not t.current)]
    hint = replica_hint(objective, [(t.metrics or {}).get(M.SLO_CAPACITY) for t in repeats], peak, peak_source,
                        tick.spec.slo.headroom_percent)
    rec = recommend(target.engine, target.deployment, target.container, setting, tick.view.spec.extra_args)
    tick.status.recommendation = Recommendation(
        setting=Setting.of(setting), args=rec.container.flat(), reason=reason[:2000],
        workload=tick.status.workload.summary if tick.status.workload else None,
        json_patch=rec.json_patch, kustomize_patch=rec.kustomize_patch, helm_values=rec.helm_values,
        replicas_hint=hint.replicas, replicas_basis=hint.basis[:500], container_name=rec.container_name,
        container=ContainerArgs.model_validate(rec.container.to_wire()))
    tick.status.best_trial = best.name
    tick.status.best_setting = setting.label()
    decision = tick.mode_decision(target)
    if decision.downgraded:
        tick.condition(ConditionType.DEGRADED, True, Reason.AUTO_DOWNGRADED, decision.why)
        tick.event(True, Reason.AUTO_DOWNGRADED, decision.why)
    if decision.mode is Mode.RECOMMEND:
        message = f"Recommended {setting.label()} ({decision.why}): {reason}" + _for(tick)
        why = Reason.TARGET_OWNED if decision.forced else Reason.RECOMMENDATION_READY
        tick.set_phase(Phase.RECOMMENDED, why, message)
        tick.event(False, why, message)
        submit_report(tick)
        return
    if decision.mode is Mode.PULL_REQUEST:
        tick.set_phase(Phase.PROPOSING, Reason.SELECTED, f"Selected {setting.label()} ({decision.why}); writing it to "
                                                         f"Git: {reason}" + _for(tick))
        submit_report(tick)
        return
    tick.set_phase(Phase.APPLYING, Reason.SELECTED, f"Selected {setting.label()} ({decision.why}): {reason}"
                   + _for(tick))
    submit_report(tick)  # again when production has verified or rolled back (controller.reconcile)


def judge_current(tick: Tick, target: Target, objective: Objective, chosen: Selection,
                  completed: list[CompletedTrial], current: TrialRecord) -> RoundVerdict:
    """A retune round: does its winner beat production's own setting, measured beside it, by the margin?"""
    assert tick.spec.retune is not None
    outcome = records.outcome_of(current, objective)
    current_value = None
    if outcome.state is TrialState.DONE and outcome.verdict is Verdict.MET and \
            evaluate_slo(outcome.metrics, tick.view.slo).verdict is Verdict.MET:
        current_value = outcome.objective
    best_value, same = None, False
    if chosen.best is not None:
        values = [c.outcome.objective for c in completed if c.setting == chosen.best and c.outcome.objective is not None]
        best_value = sum(values) / len(values) if values else None
        desired = production_args(target.engine, target.container, chosen.best, tick.view.spec.extra_args)
        same = desired == ProductionArgs.of(target.container)
    judged = judge_round(OBJECTIVE_WORDS[objective], chosen.best.label() if chosen.best else None, best_value,
                         current.setting.core().label(), current_value, same, tick.spec.retune.min_improvement_percent)
    records.record_round(tick.status, current, current_value, chosen.best_trial, chosen.best.label() if chosen.best else None,
                        best_value, judged)
    return judged


def keep(tick: Tick, target: Target, objective: Objective, current: TrialRecord, judged: RoundVerdict,
         none_feasible: bool) -> None:
    """Production keeps its setting: the recommendation is production as it runs, no patch to apply."""
    assert judged.reason is not None
    try:
        peak, peak_source = tick.production_peak(target)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        return
    hint = replica_hint(objective, [(current.metrics or {}).get(M.SLO_CAPACITY)] if current.verdict is Verdict.MET
                        else [None], peak, peak_source, tick.spec.slo.headroom_percent)
    runs = ProductionArgs.of(target.container)
    tick.status.recommendation = Recommendation(
        setting=current.setting, args=runs.flat(), reason=judged.message[:2000],
        workload=tick.status.workload.summary if tick.status.workload else None, json_patch="[]",
        kustomize_patch=kustomize_patch(target.deployment, str(target.container["name"]), target.container),
        replicas_hint=hint.replicas, replicas_basis=hint.basis[:500], container_name=str(target.container["name"]),
        container=ContainerArgs.model_validate(runs.to_wire()))
    tick.status.best_trial = current.name
    tick.status.best_setting = current.setting.summary()
    phase = Phase.SUCCEEDED if tick.apply_mode(target) == Mode.AUTO else Phase.RECOMMENDED
    message = f"Kept production's setting ({current.setting.summary()}): {judged.message}" + _for(tick)
    tick.set_phase(phase, judged.reason, message)
    submit_report(tick)  # after the phase, so the page names it
    if none_feasible:
        tick.condition(ConditionType.DEGRADED, True, Reason.NO_FEASIBLE_SETTING, message)
        tick.event(True, Reason.NO_FEASIBLE_SETTING, message)


def _for(tick: Tick) -> str:
    """`; for <workload>`: the workload a decision holds for."""
    workload = tick.status.workload
    return f"; for {workload.summary}" if workload is not None and workload.summary else ""
