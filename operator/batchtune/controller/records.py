"""Status records <-> core types: the one place the controller turns the BatchTuning's status into what the core
decides on, and the core's answers back into status records.

Phase modules read and write status only through these functions (and the records' own fields); none converts on
its own. The api models convert themselves to core types (`.core()`) and from them (`.of()`); what needs more than
one record, or a rule about which records count, is here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from batchtune.api import (
    LoadStepRecord,
    PlanRecord,
    RunRecord,
    Setting,
    TrialPrediction,
    TrialRecord,
    TwinPredictionRecord,
    TwinRecord,
    WorkloadRecord,
)
from batchtune.api.models import BatchTuningSpec, BatchTuningStatus, LoadSpec, RoundRecord, camel
from batchtune.core import autoscale, protocol, trial_loop
from batchtune.core.gpus import held_minutes
from batchtune.core.guidance import KEPT_PREDICTIONS, Agreement, Predicted, TwinAdvice, measured
from batchtune.core.objective import Objective, objective_value
from batchtune.core.outcomes import HistoryEntry, StepObservation, TrialOutcome
from batchtune.core.planning import EngineLimits, PrunedSetting
from batchtune.core.protocol import CurveLoad, Neighbour, RunResult, StepResult
from batchtune.core.retune import RoundVerdict, finite
from batchtune.core.settings import Setting as CoreSetting
from batchtune.core.trial_loop import Step
from batchtune.core.tuning import View
from batchtune.core.vocabulary import M, Reason, StepPurpose, TrialState, Verdict

if TYPE_CHECKING:
    from batchtune.engines import Engine

# ---- load steps -------------------------------------------------------------------------------


def run_result(record: RunRecord) -> RunResult:
    return RunResult(record.metrics, record.cross_check)


def as_stored(result: RunResult) -> RunResult:
    """A run's figures as status keeps them (NaN dropped, an infinite latency capped): what later ticks read."""
    return run_result(RunRecord(metrics=dict(result.metrics), cross_check=result.cross_check))


def step_of(record: LoadStepRecord) -> Step:
    """A step record as the trial loop's step."""
    result = None
    if record.verdict is not None:
        result = StepResult(record.load, dict(record.metrics or {}), Verdict(record.verdict),
                            record.verdict_reason or "", record.margin if record.margin is not None else -math.inf,
                            record.cross_check, record.purpose is not StepPurpose.BRACKET)
    return Step(record.load, record.purpose, record.measure_seconds, record.lengthened,
                tuple(run_result(r) for r in record.results), result)


def steps_of(trial: TrialRecord) -> tuple[Step, ...]:
    return tuple(step_of(s) for s in trial.steps)


def step_record(step: Step) -> LoadStepRecord:
    """The record of a step the loop opened (its intent, before any Job)."""
    return LoadStepRecord(load=step.load, purpose=step.purpose, measure_seconds=step.seconds)


def write_step(record: LoadStepRecord, step: Step) -> None:
    """The loop's step into its record: its window and runs, or, once closed, its result (the per-run data goes,
    to keep status small)."""
    record.measure_seconds = step.seconds
    record.lengthened = step.lengthened
    result = step.result
    if result is None:
        record.results = [RunRecord(metrics=dict(r.metrics), cross_check=r.cross_check) for r in step.runs]
        return
    record.results = []
    record.metrics = None if step.curve and not result.metrics else dict(result.metrics)
    record.verdict = result.verdict
    record.verdict_reason = result.verdict_reason
    record.margin = result.margin if math.isfinite(result.margin) else None
    record.cross_check = result.cross_check


def compact(trial: TrialRecord) -> None:
    """A finished trial's steps as status keeps them: its conclusion stands, so at most `trial_loop.KEPT_STEPS`
    closed steps stay (`trial_loop.kept`: the curve point, the capacity step, the step at the twin's prediction or
    the first, where the SLO broke), without their per-run bookkeeping (Job, runs, attempts). Only a running trial
    needs every step; the bound keeps a tuning at the CRD's every maximum inside etcd's object limit."""
    capacity = (trial.metrics or {}).get(M.SLO_CAPACITY_LOAD) if trial.state is TrialState.DONE else None
    predicted = trial.prediction.capacity_load if trial.prediction is not None else None
    keep = trial_loop.kept(steps_of(trial), trial.curve_step, capacity, predicted)
    curve = trial.curve_step
    trial.steps = [trial.steps[i].model_copy(update={"job": None, "results": [], "repeat": 0, "attempt": 0,
                                                      "unavailable_since": None}) for i in keep]
    trial.curve_step = keep.index(curve) if curve in keep else None


def search_steps(trial: TrialRecord) -> list[StepResult]:
    """The closed steps of the trial's own search, in order (never the curve step)."""
    return [r for s in trial.steps if s.purpose is not StepPurpose.CURVE and (r := step_of(s).result) is not None]


def curve_of(plan: PlanRecord | None) -> CurveLoad | None:
    """The common load of the report's curves, as planning fixed it (None: none, or status predates it)."""
    record = plan.curve_load if plan else None
    if record is None:
        return None
    if record.requests_per_minute is not None:
        return CurveLoad(record.requests_per_minute, True, record.source)
    return CurveLoad(record.concurrency, False, record.source) if record.concurrency is not None else None


# ---- trials as the search and the selection see them ------------------------------------------------


def outcome_of(trial: TrialRecord, objective: Objective) -> TrialOutcome:
    metrics = dict(trial.metrics or {})
    steps = tuple(StepObservation(s.load, dict(s.metrics or {}), Verdict(s.verdict), s.margin)
                  for s in trial.steps if s.verdict is not None and s.purpose is not StepPurpose.CURVE)
    return TrialOutcome(TrialState(trial.state), Verdict(trial.verdict or Verdict.UNKNOWN),
                        objective_value(objective, metrics), metrics, str(trial.reason or ""), trial.message or "",
                        steps)


def history(trials: Sequence[TrialRecord], objective: Objective,
            current_is_candidate: bool = False) -> tuple[list[HistoryEntry], list[CoreSetting]]:
    """Finished trials as (Setting, TrialOutcome) in trial order, and the settings still running.

    Production's own setting (a retune round's trial 0) is the search's only when production runs exactly the
    command line a candidate of that setting would (`current_is_candidate`); otherwise it may lie outside the search
    space, or differ from the candidate (extra args), and is left out.
    """
    done: list[HistoryEntry] = []
    pending = []
    for trial in trials:
        if trial.current and not current_is_candidate:
            continue
        if trial.state.finished:
            done.append((trial.setting.core(), outcome_of(trial, objective)))
        else:
            pending.append(trial.setting.core())
    return done, pending


def neighbours(trials: Sequence[TrialRecord], besides: TrialRecord) -> list[Neighbour]:
    """The finished trials' capacities a new trial's search may start from."""
    return protocol.neighbours_of([(t.setting.core(), t.metrics or {}) for t in trials
                                   if t.state is TrialState.DONE and t is not besides])


def pruned(status: BatchTuningStatus) -> list[PrunedSetting]:
    return [PrunedSetting(p.setting.core(), Reason(p.reason), p.message,
                          Reason(p.memory_reason) if p.memory_reason else None) for p in status.pruned]


def engine_limits(plan: PlanRecord | None) -> EngineLimits:
    record = plan.engine_limits if plan else None
    if record is None:
        return EngineLimits()
    return EngineLimits(record.max_model_len, record.chunked_prefill is not False, record.max_num_batched_tokens)


def spec_workload(load: LoadSpec) -> WorkloadRecord:
    """The workload of a tuning that does not measure production: spec.load's trace or fixed lengths."""
    if load.trace_config_map_ref is not None:
        ref = load.trace_config_map_ref
        return WorkloadRecord(source="trace", summary=f"the trace in ConfigMap {ref.name} key {ref.key} "
                                                      "(spec.load.traceConfigMapRef), replayed as is")
    if load.concurrency is not None:
        arrivals = f"closed loop at {load.concurrency} concurrent requests"
    elif load.requests_per_minute is not None:
        arrivals = f"Poisson arrivals at {load.requests_per_minute} requests/min"
    else:
        arrivals = "closed loop at each trial's load steps"
    return WorkloadRecord(source="spec", input_tokens=load.input_tokens, output_tokens=load.output_tokens,
                          requests_per_minute=load.requests_per_minute,
                          summary=f"spec.load: {load.input_tokens} prompt and {load.output_tokens} output tokens "
                                  f"per request (fixed), {arrivals}")


def record_round(status: BatchTuningStatus, current: TrialRecord, current_value: float | None,
                 best_trial: str | None, best_setting: str | None, best_value: float | None,
                 judged: RoundVerdict) -> None:
    """What a retune round compared: production's setting and the best other one."""
    if not status.rounds:
        return
    last: RoundRecord = status.rounds[-1]
    last.current_trial, last.current_setting = current.name, current.setting.summary()
    last.current_objective = finite(current_value)
    last.best_trial, last.best_setting, last.best_objective = best_trial, best_setting, finite(best_value)
    last.improvement_percent = finite(judged.improvement_percent)


def current_setting(status: BatchTuningStatus, engine: Engine) -> CoreSetting:
    """Production's knobs as planning read them, the engine's defaults where it sets none (for naming)."""
    baseline = status.baseline
    seqs = (baseline.max_num_seqs if baseline else None) or engine.default_max_num_seqs or 1
    gmu = (baseline.gpu_memory_utilization_percent if baseline else None) or \
        engine.default_gpu_memory_utilization_percent
    return CoreSetting(seqs, gmu, baseline.max_num_batched_tokens if baseline else None)


def current_is_candidate(status: BatchTuningStatus, view: View, engine: Engine, container: Mapping[str, Any]) -> bool:
    """Whether the round's trial 0 ran exactly what a candidate of its setting would: then it counts as one."""
    current = next((t for t in status.trials if t.current), None)
    if current is None:
        return False
    setting = current.setting.core()
    if not view.spec.space.contains(setting):
        return False
    rewritten = engine.rewrite(container, setting, view.spec.extra_args)
    return all(rewritten.get(k) == container.get(k) for k in ("command", "args"))


def capacity(namespace: str, name: str, spec: BatchTuningSpec, status: BatchTuningStatus) -> autoscale.Capacity:
    """The SLO capacity per replica the recommendation was measured at, as an autoscaler's target
    (`autoscale.NoCapacity` when there is none)."""
    rec = status.recommendation
    trials = [autoscale.Measured(t.setting.core(), t.state is TrialState.DONE, (t.metrics or {}).get(M.SLO_CAPACITY))
              for t in status.trials]
    return autoscale.capacity(f"{namespace}/{name}", namespace, spec.target_ref.name,
                              rec.setting.core() if rec else None, trials, spec.slo.headroom_percent,
                              rec.replicas_hint if rec else None)


# ---- the twin's advice (strategy TwinGuided) -----------------------------------------------------------------


def launched(trials: Sequence[TrialRecord]) -> dict[CoreSetting, Predicted]:
    """What was predicted for each trial when it was started."""
    out = {}
    for trial in trials:
        p = trial.prediction
        if p is not None:
            out[trial.setting.core()] = Predicted(trial.setting.core(), p.objective, p.capacity_load,
                                                  dict(p.metrics or {}), p.simulated)
    return out


def advice_of(record: TwinRecord, trials: Sequence[TrialRecord]) -> TwinAdvice:
    """The advice as status holds it (what every tick asks the strategy with)."""
    agreements = {t.setting.core(): Agreement(bool(t.prediction.agrees), t.prediction.comparison or "")
                  for t in trials if t.prediction is not None and t.prediction.agrees is not None}
    ranked = tuple(Predicted(p.setting.core(), p.objective, p.capacity_load, dict(p.metrics or {}), p.simulated)
                   for p in record.predictions)
    return TwinAdvice(basis=record.basis, available=record.available, trusted=record.verdict != "Untrusted",
                      reason=record.reason or "", calibration_setting=record.calibration_setting.core()
                      if record.calibration_setting else None, ranked=ranked, agreements=agreements)


def twin_record(fresh: TwinAdvice, verdict: str, params: dict[str, Any] | None, worst_error: float | None,
                history: Sequence[HistoryEntry]) -> TwinRecord:
    """The advice into its status record: the ranking, the verdict and the fitted parameters (`params`: the
    calibration's, nested by group)."""
    parameters: dict[str, float] = {}
    for key, value in (params or {}).items():
        if isinstance(value, dict):
            parameters.update({camel(f"{key}_{k}"): float(v) for k, v in value.items()})
        elif isinstance(value, (int, float)):
            parameters[camel(key)] = float(value)
    worst = round(100 * worst_error, 1) if worst_error is not None and worst_error != float("inf") else None
    return TwinRecord(
        basis=fresh.basis, available=fresh.available, verdict=verdict, reason=fresh.reason[:1000],
        calibration_setting=Setting.of(fresh.calibration_setting) if fresh.calibration_setting else None,
        parameters=parameters, observations=sum(len(o.steps) for _, o in measured(history)),
        worst_residual_percent=worst, ranked=len(fresh.ranked),
        predictions=[TwinPredictionRecord(setting=Setting.of(p.setting), objective=max(0.0, p.objective),
                                          capacity_load=p.capacity_load, metrics=dict(p.metrics),
                                          simulated=p.simulated) for p in fresh.ranked[:2 * KEPT_PREDICTIONS]],
        search_seconds=fresh.seconds, notes=[n[:300] for n in fresh.notes][:10])


def write_agreements(trials: Sequence[TrialRecord], fresh: TwinAdvice) -> None:
    """On each trial launched on a prediction: whether its first step agreed with it."""
    for trial in trials:
        found = fresh.agreements.get(trial.setting.core())
        if trial.prediction is not None and found is not None:
            trial.prediction.agrees = found.agrees
            trial.prediction.comparison = found.worst[:500]


def prediction(advice: TwinAdvice, setting: CoreSetting) -> TrialPrediction | None:
    """The record a trial launched on the advice carries (none while the calibration is Untrusted)."""
    found = advice.launch_prediction(setting)
    if found is None:
        return None
    return TrialPrediction(objective=max(0.0, found.objective), capacity_load=found.capacity_load,
                           metrics=dict(found.metrics), simulated=found.simulated)


# ---- the GPU budget --------------------------------------------------------------------------------------


def gpu_minutes_spent(status: BatchTuningStatus, now: datetime) -> float:
    """Device-minutes this BatchTuning's trials held: the trials in status and those carried from earlier generations,
    rounds and plans (`gpu_minutes_carried`). The figure the GPU budget bounds."""
    return round(status.gpu_minutes_carried + held_minutes(((t.gpus, t.started_at, t.finished_at)
                                                            for t in status.trials), now), 2)


def carry_gpu_minutes(old: BatchTuningStatus, fresh: BatchTuningStatus, now: datetime) -> None:
    """A new generation, round or plan drops the trials from status: their minutes stay in the total (running ones
    count until now; their objects go in this tick's garbage pass)."""
    fresh.gpu_minutes_carried = gpu_minutes_spent(old, now)
    fresh.gpu_minutes = float(math.floor(fresh.gpu_minutes_carried))
