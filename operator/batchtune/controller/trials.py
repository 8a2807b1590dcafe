"""Trialing: advance every running trial one step, start new ones while the search, GPUs and budget allow.

Intent first: a trial is written to status before its Deployment is created, a load run's Job name
before the Job; an outcome is written before the trial's objects go (the garbage pass deletes
objects of finished trials on a later tick, once status says so). Every step is safe to repeat.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from batchtune.api import (
    LoadStepRecord,
    PlanRecord,
    RunRecord,
    Setting,
    StepPurpose,
    TrialPrediction,
    TrialRecord,
    WorkloadRecord,
)
from batchtune.api.models import BatchTuningSpec, Generator
from batchtune.controller import guidance
from batchtune.controller.ports import Owned
from batchtune.controller.prometheus import PrometheusUnavailable
from batchtune.controller.tick import Target, Tick
from batchtune.core import measurement, protocol
from batchtune.core.gpus import container_gpus, eligible_nodes, node_usage, trials_that_fit
from batchtune.core.guidance import TwinAdvice
from batchtune.core.manifests import (
    LoadProfile,
    build_bench_job,
    build_load_job,
    build_trial_deployment,
    load_job_name,
    trial_name,
)
from batchtune.core.objective import Objective, objective_value
from batchtune.core.outcomes import HistoryEntry, StepObservation, TrialOutcome
from batchtune.core.planning import EngineLimits, SearchSpace
from batchtune.core.planning import PrunedSetting as CorePruned
from batchtune.core.pods import TrialFailure, classify_pod, log_wanted, pod_is_ready
from batchtune.core.policy import gpu_minutes_budget
from batchtune.core.production import fingerprint
from batchtune.core.protocol import CurveLoad, ProtocolConfig, RunResult, StepResult
from batchtune.core.search import Search
from batchtune.core.settings import Setting as CoreSetting
from batchtune.core.slo import MIN_SAMPLES, SloTargets
from batchtune.core.vocabulary import ConditionType, M, Phase, Reason, TrialState, Verdict
from batchtune.core.warmup import steady_warmup
from batchtune.core.workload import bucket_text

SAMPLES_FLOOR = 2 * MIN_SAMPLES
"""Requests the first open-loop step of a capacity search should hold in its window (twice what a verdict needs)."""
TRACE_AS_IS_PERCENT = 100
"""A trace replayed at 100% of its speed is replayed as is (the capacity search may speed it up)."""
# A load run whose data never shows up is run again this many times, then the trial is Failed.
MAX_MEASURE_ATTEMPTS = 3
# Failures that say the setting itself cannot work: the search prunes on them.
INFEASIBLE = frozenset({Reason.OOM_KILLED, Reason.OUT_OF_MEMORY, Reason.KV_CACHE_TOO_SMALL,
                        Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, Reason.ENGINE_REFUSED_ARGS,
                        Reason.CRASH_LOOP_BACK_OFF})


# ---- status <-> protocol -------------------------------------------------------------------


def protocol_config(spec: BatchTuningSpec, workload: WorkloadRecord | None,
                    scrape_interval_seconds: float | None = None) -> ProtocolConfig:
    """How this BatchTuning measures its trials.

    With fromProduction and neither concurrency nor requestsPerMinute, the load is open loop at
    production's own peak rate per replica (a trial is one replica; a capacity search starts there),
    with its burstiness. Bracketing steps are short when the install's scrape interval allows
    (`bracket_window`); without it (a prediction's config) every step is full.
    """
    objective = Objective(spec.objective.type)
    load = spec.load
    rate = load.requests_per_minute
    profile = workload.profile() if workload is not None else None
    peak = profile.peak_per_replica() if profile is not None else None
    first = None
    if rate is None and load.concurrency is None and load.from_production and peak:
        rate = max(1, round(peak * 60))
        if objective.searches_capacity and not load.num_prompts:
            # A quiet production's peak would give a first step too few requests to judge (Unknown):
            # the search starts where one window holds enough of them, and walks down if that fails.
            first = max(rate, math.ceil(SAMPLES_FLOOR * 60 / spec.trial.measure_seconds))
    trace = load.trace_config_map_ref is not None
    if trace:
        rate = TRACE_AS_IS_PERCENT  # a trace's loads are percent of its own speed
    fixed = rate if rate is not None else load.concurrency
    bracketing = scrape_interval_seconds is not None and bracket_window(spec, scrape_interval_seconds) is not None
    return ProtocolConfig(objective=objective, slo=SloTargets.from_spec(spec.slo), open_loop=rate is not None,
                          repeats=spec.trial.repeats, fixed_load=fixed, first_load=first or fixed, trace=trace,
                          bracketing=bracketing)


BRACKET_SCRAPES = 3
"""A defaulted bracketing window spans at least this many scrape intervals (a rate needs two samples in it)."""


def bracket_window(spec: BatchTuningSpec, scrape_interval_seconds: float) -> int | None:
    """The window of the search's short steps, or None when every step runs measureSeconds (numPrompts runs
    are counted, not timed)."""
    if spec.load.num_prompts:
        return None
    return protocol.bracket_seconds(spec.trial.measure_seconds, spec.trial.bracket_seconds,
                                    BRACKET_SCRAPES * scrape_interval_seconds)


def goodput_targets(spec: BatchTuningSpec) -> tuple[tuple[str, int], ...]:
    """The SLO's targets, per request, in the load generators' goodput terms (ITL is a request's TPOT)."""
    slo = spec.slo
    pairs = (("ttft", slo.ttft_milliseconds), ("tpot", slo.inter_token_latency_milliseconds),
             ("e2el", slo.e2e_latency_milliseconds))
    return tuple((key, ms) for key, ms in pairs if ms is not None)


def curve_of(plan: PlanRecord | None) -> CurveLoad | None:
    """The common load of the report's curves, as planning fixed it (None: none, or status predates it)."""
    record = plan.curve_load if plan else None
    if record is None:
        return None
    if record.requests_per_minute is not None:
        return CurveLoad(record.requests_per_minute, True, record.source)
    return CurveLoad(record.concurrency, False, record.source) if record.concurrency is not None else None


def is_curve(step: LoadStepRecord) -> bool:
    return step.purpose is StepPurpose.CURVE


def is_bracket(step: LoadStepRecord) -> bool:
    return step.purpose is StepPurpose.BRACKET


def search_steps(trial: TrialRecord) -> list[StepResult]:
    """The closed steps of the trial's own search, in order: all the protocol decides on (never the curve step)."""
    return [step_result(s) for s in trial.steps if s.verdict is not None and not is_curve(s)]


def step_result(step: LoadStepRecord) -> StepResult:
    assert step.verdict is not None
    return StepResult(step.load, dict(step.metrics or {}), Verdict(step.verdict), step.verdict_reason or "",
                      step.margin if step.margin is not None else -math.inf, step.cross_check, not is_bracket(step))


def close(step: LoadStepRecord, config: ProtocolConfig) -> None:
    closed = protocol.close_step(step.load, [RunResult(r.metrics, r.cross_check) for r in step.results], config,
                                 not is_bracket(step))
    step.metrics = dict(closed.metrics)
    step.verdict = closed.verdict
    step.verdict_reason = closed.verdict_reason
    step.margin = closed.margin if math.isfinite(closed.margin) else None
    step.cross_check = closed.cross_check
    step.results = []  # keep status small: the step's summary stays, per-repeat data goes


def outcome_of(trial: TrialRecord, objective: Objective) -> TrialOutcome:
    metrics = dict(trial.metrics or {})
    steps = tuple(StepObservation(s.load, dict(s.metrics or {}), Verdict(s.verdict), s.margin)
                  for s in trial.steps if s.verdict is not None and not is_curve(s))
    return TrialOutcome(TrialState(trial.state), Verdict(trial.verdict or Verdict.UNKNOWN),
                        objective_value(objective, metrics), metrics, str(trial.reason or ""), trial.message or "",
                        steps)


def history(trials: list[TrialRecord], objective: Objective,
            current_is_candidate: bool = False) -> tuple[list[HistoryEntry], list[Any]]:
    """Finished trials as (Setting, TrialOutcome) in trial order, and the settings still running.

    Production's own setting (a retune round's trial 0) is the search's only when production runs
    exactly the command line a candidate of that setting would (`current_is_candidate`); otherwise it
    may lie outside the search space, or differ from the candidate (extra args), and is left out.
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


def search(tick: Tick, advice: TwinAdvice | None = None) -> Search:
    """The strategy rebuilt from spec and status alone (pure), so a restarted operator asks the same.

    `advice`: the calibrated twin's, as status holds it (strategy TwinGuided)."""
    assert tick.spec is not None and tick.status.plan is not None
    engine = tick.engine_named(tick.status.baseline.engine if tick.status.baseline else None)
    limits_record = tick.status.plan.engine_limits
    limits = EngineLimits(limits_record.max_model_len, limits_record.chunked_prefill is not False,
                          limits_record.max_num_batched_tokens) if limits_record else EngineLimits()
    pruned = [CorePruned(p.setting.core(), Reason(p.reason), p.message,
                         Reason(p.memory_reason) if p.memory_reason else None) for p in tick.status.pruned]
    return Search.start(tick.spec.strategy.type.value, SearchSpace.from_spec(tick.spec.search_space),
                        lambda s: engine.invariant_violation(s, limits), pruned, tick.slo(),
                        Objective(tick.spec.objective.type), tick.spec.strategy.seed, tick.spec.strategy.max_trials,
                        advice)


def gpu_minutes(trials: list[TrialRecord], now: datetime) -> float:
    total = 0.0
    for trial in trials:
        if trial.started_at is None or not trial.gpus:
            continue
        end = trial.finished_at or now
        total += trial.gpus * max(0.0, (end - trial.started_at).total_seconds()) / 60
    return round(total, 2)


# ---- the phase -----------------------------------------------------------------------------


def trials(tick: Tick) -> None:
    assert tick.spec is not None
    target = tick.target()
    if target is None:
        return
    if tick.status.baseline and tick.status.baseline.fingerprint != fingerprint(target.container):
        target_changed(tick, target)
        return
    owned = tick.ports.cluster.owned(tick.tuning.namespace, tick.tuning.uid)
    config = protocol_config(tick.spec, tick.status.workload, tick.ports.install.scrape_interval_seconds)
    for trial in tick.status.trials:
        if trial.state in (TrialState.PENDING, TrialState.DEPLOYING):
            deploying(tick, target, trial, owned)
        elif trial.state in (TrialState.WARMING, TrialState.MEASURING):
            measuring(tick, target, trial, owned, config)
    spent = gpu_minutes(tick.status.trials, tick.now)
    # Whole minutes in status: a figure that moves every tick would cost a status write every tick.
    tick.status.gpu_minutes = float(math.floor(spent))
    budget = gpu_minutes_budget(tick.spec.strategy.max_gpu_minutes, tick.ports.install.max_gpu_minutes)
    exhausted = spent >= budget
    if exhausted:
        for trial in tick.status.trials:
            if trial.state.finished:
                continue
            message = (f"the tuning reached its GPU budget of {budget} GPU-minutes (spec.strategy.maxGpuMinutes, "
                       "capped by the install)")
            if search_done(tick, trial, config):
                pending = next((s for s in trial.steps if is_curve(s) and s.verdict is None), None)
                curve = curve_of(tick.status.plan)
                if pending is None and curve is not None:
                    pending = LoadStepRecord(load=curve.load, purpose=StepPurpose.CURVE)  # why it is missing
                    trial.steps.append(pending)
                if pending is None:
                    conclude(tick, trial, config)
                    continue
                give_up_curve(tick, trial, pending, config, f"{Reason.GPU_BUDGET_EXHAUSTED.value}: {message}")
            else:
                finish(tick, trial, TrialState.FAILED, Reason.GPU_BUDGET_EXHAUSTED, message, Verdict.UNKNOWN)
    strategy_done = False if exhausted else launch(tick, target, owned)
    finished = [t for t in tick.status.trials if t.state.finished]
    tick.status.trials_completed = len(finished)
    active = [t for t in tick.status.trials if not t.state.finished]
    if not active and (exhausted or strategy_done or len(tick.status.trials) >= tick.status.trials_planned):
        why = f"{len(finished)} trials finished" + (f"; GPU budget of {budget} GPU-minutes reached" if exhausted else "")
        tick.set_phase(Phase.SELECTING, Reason.GPU_BUDGET_EXHAUSTED if exhausted else Reason.TRIALS_DONE, why)
        if exhausted:
            tick.event(True, Reason.GPU_BUDGET_EXHAUSTED, why)


def target_changed(tick: Tick, target: Target) -> None:
    """Production's container changed under the tuning: the measurements no longer hold, plan again."""
    message = (f"Deployment {tick.tuning.namespace}/{target.name} changed its engine container (image, command, args, "
               "env or resources) during tuning; the trials measured the old one, so tuning starts over")
    for trial in tick.status.trials:
        if not trial.state.finished:
            finish(tick, trial, TrialState.FAILED, Reason.TARGET_CHANGED, message, Verdict.UNKNOWN)
    tick.status.trials = []
    tick.status.pruned = []
    tick.status.plan = None
    tick.status.baseline = None
    tick.status.trials_planned = 0
    tick.status.trials_completed = 0
    tick.set_phase(Phase.PENDING, Reason.TARGET_CHANGED, message)
    tick.event(True, Reason.TARGET_CHANGED, message)


def launch(tick: Tick, target: Target, owned: Owned) -> bool:
    """Start trials while slots, GPUs and the search allow; True when the search has nothing more to ask."""
    assert tick.spec is not None
    trials_ = tick.status.trials
    active = [t for t in trials_ if not t.state.finished]
    budget = tick.status.trials_planned - len(trials_)
    slots = min(tick.spec.strategy.max_parallel_trials - len(active), budget)
    if slots <= 0:
        return budget <= 0
    per_trial = container_gpus(target.container)
    if per_trial:
        fit = gpus_free_for(tick, target, per_trial, owned)
        if fit is not None:
            slots = min(slots, fit)
            if slots <= 0:
                tick.waiting(Reason.WAITING_FOR_GPUS,
                             f"No node has {per_trial} free nvidia.com/gpu for the next trial"
                             + (f" (product {tick.status.plan.gpu_product})" if tick.status.plan and
                                tick.status.plan.gpu_product else "") + "; waiting")
                return False
    if (tick.status.round or 1) > 1 and not any(t.current for t in trials_):
        start_trial(tick, current_setting(tick, target), per_trial, current=True)
        slots -= 1
        if slots <= 0:
            return False
    objective = Objective(tick.spec.objective.type)
    the_search = search(tick)
    as_candidate = current_is_candidate(tick, target)
    advice = None
    for _ in range(slots):
        done, pending = history(trials_, objective, as_candidate)
        if tick.spec.strategy.type.value == guidance.KIND:
            advice = guidance.advice(tick, target, the_search, done)
            if advice is None:
                return False  # the twin is calibrating and searching; a later tick asks again
            the_search = search(tick, advice)
        setting = the_search.ask(done, pending)
        if setting is None:
            return not pending
        trial = start_trial(tick, setting, per_trial,
                            prediction=guidance.prediction(advice, setting) if advice is not None else None)
        progressing = tick.status.condition(ConditionType.PROGRESSING)
        if progressing is not None and progressing.reason == Reason.TWIN_SEARCHING:
            tick.condition(ConditionType.PROGRESSING, True, Reason.TRIAL_STARTED, f"Trial {trial.name}: {setting.label()}")
    return False


def start_trial(tick: Tick, setting: CoreSetting, gpus: int, current: bool = False,
                prediction: TrialPrediction | None = None) -> TrialRecord:
    """The intent of a trial, in status: its Deployment is created on the next tick, after this is written.

    `prediction`: what the calibrated twin predicted for it (strategy TwinGuided)."""
    index = tick.status.next_trial_index
    tick.status.next_trial_index = index + 1
    trial = TrialRecord(index=index, name=trial_name(tick.tuning.name, index), setting=Setting.of(setting),
                        state=TrialState.DEPLOYING, started_at=tick.now, gpus=gpus, current=True if current else None,
                        prediction=prediction)
    tick.status.trials.append(trial)
    what = f"production's own setting ({setting.label()}, its command line as it runs)" if current else setting.label()
    tick.event(False, Reason.TRIAL_STARTED, f"Trial {trial.name}: {what}")
    tick.log.info("Started trial %s: %s", trial.name, what)
    return trial


def current_is_candidate(tick: Tick, target: Target) -> bool:
    """Whether the round's trial 0 ran exactly what a candidate of its setting would: then it counts as one."""
    assert tick.spec is not None
    current = next((t for t in tick.status.trials if t.current), None)
    if current is None:
        return False
    space = SearchSpace.from_spec(tick.spec.search_space)
    setting = current.setting.core()
    if setting.max_num_seqs not in space.max_num_seqs or \
            setting.gpu_memory_utilization_percent not in space.gpu_memory_utilization_percent or \
            (setting.max_num_batched_tokens not in space.max_num_batched_tokens if space.max_num_batched_tokens
             else setting.max_num_batched_tokens is not None):
        return False
    rewritten = target.engine.rewrite(target.container, setting, tuple(tick.spec.search_space.extra_args or ()))
    return all(rewritten.get(k) == target.container.get(k) for k in ("command", "args"))


def current_setting(tick: Tick, target: Target) -> CoreSetting:
    """Production's knobs as planning read them, the engine's defaults where it sets none (for naming)."""
    baseline = tick.status.baseline
    engine = target.engine
    seqs = (baseline.max_num_seqs if baseline else None) or engine.default_max_num_seqs or 1
    gmu = (baseline.gpu_memory_utilization_percent if baseline else None) or \
        engine.default_gpu_memory_utilization_percent
    return CoreSetting(seqs, gmu, baseline.max_num_batched_tokens if baseline else None)


def gpus_free_for(tick: Tick, target: Target, per_trial: int, owned: Owned) -> int | None:
    """How many more trials fit on production's kind of node; None when this install cannot see nodes."""
    cluster = tick.ports.cluster
    nodes = cluster.nodes()
    pods = cluster.gpu_pods()
    if nodes is None or pods is None:
        return None
    product = tick.status.plan.gpu_product if tick.status.plan else None
    eligible = eligible_nodes(nodes, target.pod_spec.get("nodeSelector") or {}, product)
    usage, unbound = node_usage(eligible, pods)
    # Our own trials decided but not created yet hold GPUs as much as pods do.
    ours = [t.gpus for t in tick.status.trials if t.state is TrialState.DEPLOYING and t.gpus
            and t.name not in owned.deployments]
    return trials_that_fit(usage, unbound + ours + cluster.gpu_intents(tick.tuning.uid), per_trial)


def trial_pod(tick: Tick, trial: TrialRecord) -> dict[str, Any] | None:
    pods = tick.ports.cluster.trial_pods(tick.tuning.namespace, tick.tuning.name, trial.index)
    # A pod the node rejected (phase Failed) is replaced by its ReplicaSet; never judge by it.
    pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "") if pods else None


def deploying(tick: Tick, target: Target, trial: TrialRecord, owned: Owned) -> None:
    assert tick.spec is not None
    if trial.name not in owned.deployments:
        services = [s.get("spec", {}).get("selector") or {} for s in tick.ports.cluster.services(tick.tuning.namespace)]
        manifest = build_trial_deployment(
            target.engine, target.deployment, target.container, tick.tuning.name, tick.tuning.uid,
            tick.tuning.namespace, trial.index, trial.setting.core(), tuple(tick.spec.search_space.extra_args or ()),
            services, tick.status.plan.gpu_product if tick.status.plan else None, as_is=bool(trial.current))
        if tick.ports.cluster.create(manifest):
            tick.log.info("Created trial Deployment %s", trial.name)
        return
    pod = trial_pod(tick, trial)
    readiness = tick.spec.trial.readiness_timeout_seconds
    if pod is not None and pod_is_ready(pod):
        trial.pod_ip = (pod.get("status") or {}).get("podIP")
        trial.port = target.engine.serving_port(target.container)
        trial.ready_at = tick.now
        trial.state = TrialState.MEASURING
        tick.log.info("Trial %s is ready at %s", trial.name, trial.pod_ip)
        return
    failure = classify_pod(pod, str(target.container["name"]), tick.now, readiness, target.engine,
                           created_at=_iso(trial.started_at), log=engine_log(tick, target, pod)) if pod else None
    if pod is None and trial.started_at and trial.started_at + timedelta(seconds=readiness) < tick.now:
        failure = TrialFailure(Reason.READINESS_TIMEOUT, f"no ready pod after {readiness}s "
                                                         "(spec.trial.readinessTimeoutSeconds)")
    if failure is not None:
        failed(tick, trial, failure)


def engine_log(tick: Tick, target: Target, pod: Mapping[str, Any]) -> str | None:
    """The engine container's log, only when it exited with a message that does not say why."""
    container = str(target.container["name"])
    previous = log_wanted(pod, container, target.engine)
    if previous is None:
        return None
    meta = pod.get("metadata") or {}
    return tick.ports.cluster.container_log(tick.tuning.namespace, str(meta.get("name")), container, previous)


def failed(tick: Tick, trial: TrialRecord, failure: TrialFailure) -> None:
    infeasible = failure.reason in INFEASIBLE
    finish(tick, trial, TrialState.INFEASIBLE if infeasible else TrialState.FAILED, failure.reason, failure.message,
           Verdict.VIOLATED if infeasible else Verdict.UNKNOWN)
    tick.event(True, Reason.TRIAL_INFEASIBLE if infeasible else Reason.TRIAL_FAILED,
               f"Trial {trial.name} ({trial.setting.summary()}): {failure.reason.value}: {failure.message}")


def measuring(tick: Tick, target: Target, trial: TrialRecord, owned: Owned, config: ProtocolConfig) -> None:
    assert tick.spec is not None
    pod = trial_pod(tick, trial)
    steps = trial.steps
    current = next((s for s in steps if s.verdict is None), None)
    if pod is None or not pod_is_ready(pod):
        failure = classify_pod(pod, str(target.container["name"]), tick.now, 0, target.engine,
                               log=engine_log(tick, target, pod)) if pod else None
        failure = failure or TrialFailure(Reason.TRIAL_POD_LOST, "the trial pod stopped being ready under load")
        if current is not None and is_curve(current):
            give_up_curve(tick, trial, current, config, f"the trial pod failed at the common load: "
                                                        f"{failure.reason.value}: {failure.message}")
        else:
            failed(tick, trial, failure)
        return
    if current is None:
        upcoming = next_step(tick, trial, config)
        if upcoming is None:
            conclude(tick, trial, config)
            return
        steps.append(new_step(tick, steps, upcoming))
        current = steps[-1]
    name = load_job_name(tick.tuning.name, trial.index, len(steps) - 1, current.repeat, current.attempt)
    if current.job != name:
        current.job = name
        return  # intent first; the Job is created on the next tick
    job = owned.jobs.get(name)
    if job is None:
        create_load_job(tick, target, trial, current, name)
        trial.state = TrialState.WARMING
        return
    run = tick.ports.cluster.job_run(tick.tuning.namespace, job)
    if not run.finished:
        if run.started and run.started + timedelta(seconds=tick.spec.trial.warmup_seconds) < tick.now:
            trial.state = TrialState.MEASURING
        return
    if run.failed:
        retry(tick, trial, current, Reason.LOAD_GENERATOR_FAILED,
              f"the load generator failed: {(run.message or 'no termination message')[:300]}")
        return
    summary = _summary(run.message)
    window = measurement.measurement_window(summary, run.started, run.ended, tick.spec.trial.warmup_seconds)
    if window is None:
        retry(tick, trial, current, Reason.MEASUREMENT_UNAVAILABLE, "the load run has no measurement window")
        return
    short = measurement.window_too_short((window.end - window.start).total_seconds(),
                                         tick.ports.install.scrape_interval_seconds,
                                         "spec.load.numPrompts" if tick.spec.load.num_prompts else
                                         "spec.trial.bracketSeconds" if is_bracket(current) else
                                         "spec.trial.measureSeconds")
    if short:
        give_up(tick, trial, current, config, Reason.MEASUREMENT_WINDOW_TOO_SHORT, short)
        return
    if window.end + timedelta(seconds=tick.ports.install.scrape_lag_seconds) > tick.now:
        return  # Prometheus needs a scrape or two after the run before its window is complete
    try:
        values = tick.reader(target.engine).trial_run(tick.tuning.namespace, str(pod["metadata"]["name"]),
                                                      tick.status.plan.served_model if tick.status.plan else None,
                                                      window)
    except PrometheusUnavailable as exc:
        # Keep the Job: its window stays in Prometheus' storage for when it comes back, up to a deadline.
        tick.prometheus_down(exc)
        current.unavailable_since = current.unavailable_since or tick.now
        if tick.now - current.unavailable_since > timedelta(seconds=tick.ports.install.measurement_deadline_seconds):
            give_up(tick, trial, current, config, Reason.MEASUREMENT_UNAVAILABLE,
                    f"Prometheus did not give this run's figures for {tick.ports.install.measurement_deadline_seconds}s: "
                    f"{exc}")
        return
    tick.prometheus_ok()
    current.unavailable_since = None
    gaps = measurement.missing(values, tuple(tick.slo().latency_targets()) if not summary else ())
    if gaps:
        retry(tick, trial, current, Reason.MEASUREMENT_UNAVAILABLE, "no complete data in Prometheus for "
              + ", ".join(gaps))
        return
    result = measurement.run_result(values, summary, config.slo.percentile)
    seconds = current.measure_seconds or tick.spec.trial.measure_seconds
    longer = None if tick.spec.load.num_prompts else protocol.longer_run(
        result.metrics, seconds, tick.spec.trial.measure_seconds, config.slo)
    if longer is not None:
        lengthen(tick, trial, current, longer, result.metrics.get(M.SAMPLES))
        return
    current.results.append(RunRecord(metrics=dict(result.metrics), cross_check=result.cross_check))
    if len(current.results) < protocol.runs_needed(is_curve(current), config):
        current.repeat += 1
        current.attempt = 0
        return
    close(current, config)
    if is_curve(current):
        trial.curve_step = steps.index(current)
    if next_step(tick, trial, config) is None:
        conclude(tick, trial, config)  # the verdict in this tick, not the next


def new_step(tick: Tick, steps: list[LoadStepRecord], upcoming: protocol.NextStep) -> LoadStepRecord:
    """The record of the trial's next step, with its window.

    A window that had to grow for an earlier search step of the same kind (short or full) is where the next
    one starts: lower loads finish fewer. The curve step starts at the spec's window (it is lengthened, as
    any run, if too few finish)."""
    assert tick.spec is not None
    if upcoming.curve:
        return LoadStepRecord(load=upcoming.load, purpose=StepPurpose.CURVE)
    grown = max((s.measure_seconds for s in steps if s.lengthened and s.measure_seconds and not is_curve(s)
                 and is_bracket(s) == upcoming.short), default=None)
    short = bracket_window(tick.spec, tick.ports.install.scrape_interval_seconds) if upcoming.short else None
    if short is None:
        return LoadStepRecord(load=upcoming.load, measure_seconds=grown)
    return LoadStepRecord(load=upcoming.load, purpose=StepPurpose.BRACKET, measure_seconds=max(short, grown or 0))


def retry(tick: Tick, trial: TrialRecord, step: LoadStepRecord, reason: Reason, message: str) -> None:
    """Run the load again as a new Job (the old one is garbage), up to MAX_MEASURE_ATTEMPTS failed ones."""
    step.attempt += 1
    tick.log.warning("Trial %s: %s; attempt %d", trial.name, message, step.attempt)
    if step.attempt - step.lengthened >= MAX_MEASURE_ATTEMPTS:
        give_up(tick, trial, step, None, reason, f"{MAX_MEASURE_ATTEMPTS} attempts: {message}")


def lengthen(tick: Tick, trial: TrialRecord, step: LoadStepRecord, seconds: int, samples: float | None) -> None:
    """Run this load again for `seconds` as a new Job: the last run finished too few requests to judge."""
    step.measure_seconds = seconds
    step.lengthened += 1
    step.attempt += 1
    tick.log.info("Trial %s: %s requests in the window at load %d; measuring %ds", trial.name,
                  "no" if not samples else int(samples), step.load, seconds)


def give_up(tick: Tick, trial: TrialRecord, step: LoadStepRecord, config: ProtocolConfig | None, reason: Reason,
            message: str) -> None:
    """A step that cannot be measured fails its trial; the curve step only goes unmeasured (the search's
    conclusion stands without it)."""
    if is_curve(step):
        assert tick.spec is not None
        give_up_curve(tick, trial, step, config or protocol_config(tick.spec, tick.status.workload,
                                                                     tick.ports.install.scrape_interval_seconds),
                      f"{reason.value}: {message}")
    else:
        finish(tick, trial, TrialState.FAILED, reason, message, Verdict.UNKNOWN)


def give_up_curve(tick: Tick, trial: TrialRecord, step: LoadStepRecord, config: ProtocolConfig, why: str) -> None:
    """The curve step is closed unmeasured (its Job becomes garbage) and the trial concludes from its search."""
    step.verdict = Verdict.UNKNOWN
    step.verdict_reason = f"not measured at the common load: {why}"[:500]
    step.metrics = None
    step.results = []
    tick.log.warning("Trial %s: no reading at the common curve load: %s", trial.name, why)
    conclude(tick, trial, config)


def next_step(tick: Tick, trial: TrialRecord, config: ProtocolConfig) -> protocol.NextStep | None:
    neighbours = protocol.neighbours_of([(t.setting.core(), t.metrics or {}) for t in tick.status.trials
                                         if t.state is TrialState.DONE and t is not trial])
    curve_done = any(is_curve(s) and s.verdict is not None for s in trial.steps)
    predicted = trial.prediction.capacity_load if trial.prediction is not None else None
    return protocol.next_step(search_steps(trial), trial.setting.core(), neighbours, config,
                              curve_of(tick.status.plan), curve_done, predicted)


def search_done(tick: Tick, trial: TrialRecord, config: ProtocolConfig) -> bool:
    """The trial's search has measured all it needs; what is left (if anything) is the curve step."""
    return any(is_curve(s) for s in trial.steps) or (
        bool(trial.steps) and all(s.verdict is not None for s in trial.steps)
        and (n := next_step(tick, trial, config)) is not None and n.curve)


def conclude(tick: Tick, trial: TrialRecord, config: ProtocolConfig) -> None:
    search = search_steps(trial)
    conclusion = protocol.conclude(search, config)
    curve = curve_of(tick.status.plan)
    if trial.curve_step is None and curve is not None:
        # A search step that ran at the common load is the trial's curve point; no extra run was needed.
        at = protocol.search_step_at(search, curve, config)
        if at is not None:
            trial.curve_step = [i for i, s in enumerate(trial.steps) if s.verdict is not None and not is_curve(s)][at]
    trial.metrics = dict(conclusion.metrics)
    finish(tick, trial, TrialState.DONE, conclusion.reason, conclusion.message, conclusion.verdict,
           conclusion.verdict_reason)
    tick.event(False, Reason.TRIAL_COMPLETED, f"Trial {trial.name} ({trial.setting.summary()}): "
                                              f"{conclusion.verdict.value}: {conclusion.verdict_reason}")


def finish(tick: Tick, trial: TrialRecord, state: TrialState, reason: Reason, message: str, verdict: Verdict,
           verdict_reason: str | None = None) -> None:
    """The trial's outcome, in status; its objects are deleted once status says so (the garbage pass)."""
    from batchtune.controller import telemetry

    trial.state = state
    trial.reason = reason
    trial.message = message[:1000]
    trial.verdict = verdict
    trial.verdict_reason = (verdict_reason or message)[:1000]
    trial.finished_at = tick.now
    telemetry.TRIALS.labels(result=state.value).inc()
    tick.log.info("Finished trial %s: %s (%s)", trial.name, state.value, reason.value)


def create_load_job(tick: Tick, target: Target, trial: TrialRecord, step: LoadStepRecord, name: str) -> None:
    assert tick.spec is not None
    load, spec = tick.spec.load, tick.spec
    workload = tick.status.workload
    config = protocol_config(spec, workload)
    measured = workload.profile() if workload is not None and load.from_production else None
    limits = tick.status.plan.engine_limits if tick.status.plan else None
    # The curve step runs the common load (a concurrency or a rate), never a trace's speed.
    curve = curve_of(tick.status.plan) if is_curve(step) else None
    open_loop = curve.open_loop if curve is not None else config.open_loop
    trace = config.trace and curve is None
    profile = LoadProfile(
        input_tokens=(workload.input_tokens if workload and workload.input_tokens else load.input_tokens),
        output_tokens=(workload.output_tokens if workload and workload.output_tokens else load.output_tokens),
        concurrency=None if open_loop else step.load,
        requests_per_minute=step.load if open_loop and not trace else None,
        trace_speed_percent=step.load if trace else None,
        trace_config_map=load.trace_config_map_ref.name if trace and load.trace_config_map_ref else None,
        trace_key=load.trace_config_map_ref.key if load.trace_config_map_ref else "trace.jsonl",
        duration_seconds=None if load.num_prompts else step.measure_seconds or spec.trial.measure_seconds,
        num_prompts=load.num_prompts, warmup_seconds=spec.trial.warmup_seconds,
        steady_warmup=steady_warmup(spec.trial.warmup, load.generator is Generator.BUILTIN,
                                    runs_on_pod(trial, step), trace),
        percentile=config.slo.percentile, seed=spec.strategy.seed + trial.index * 1000 + len(trial.steps),
        burstiness=measured.burstiness if measured is not None else 1.0,
        prompt_lengths=bucket_text(measured.prompt) if measured is not None else None,
        output_lengths=bucket_text(measured.output) if measured is not None else None,
        max_model_len=limits.max_model_len if limits else None,
        goodput_ms=goodput_targets(spec))
    model = tick.status.plan.served_model if tick.status.plan and tick.status.plan.served_model else ""
    base_url = f"http://{trial.pod_ip}:{trial.port}"
    operator_image = tick.ports.install.operator_image
    if load.generator.value == "VllmBench":
        tokenizer = tick.status.plan.model if tick.status.plan else None
        job = build_bench_job(target.engine, tick.tuning.name, tick.tuning.uid, tick.tuning.namespace, trial.index,
                              name, image=load.image or str(target.container.get("image", "")),
                              operator_image=operator_image, base_url=base_url, model=model, tokenizer=tokenizer,
                              profile=profile)
    else:
        job = build_load_job(tick.tuning.name, tick.tuning.uid, tick.tuning.namespace, trial.index, name,
                             image=load.image or operator_image, base_url=base_url, model=model, profile=profile)
    tick.ports.cluster.create(job)


def runs_on_pod(trial: TrialRecord, step: LoadStepRecord) -> int:
    """Load runs that already ended on the trial's pod before this step's next one: one per closed step, and
    this step's finished repeats and lengthened runs."""
    return sum(1 for s in trial.steps if s is not step and s.verdict is not None) + len(step.results) + step.lengthened


def _summary(message: str | None) -> dict[str, Any] | None:
    if not message:
        return None
    try:
        summary = json.loads(message)
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None


def _iso(value: datetime | None) -> str | None:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


