"""Trialing: advance every running trial one step, start new ones while the search, GPUs and budget allow.

Each trial's runs follow the trial loop (`core.trial_loop`), the same the bench drives; this module only sequences it
across ticks with the cluster's ports: a run is a load Job, read from Prometheus once its window is complete.
Intent first: a trial is written to status before its Deployment is created, a load run's Job name before the
Job; an outcome is written before the trial's objects go (the garbage pass deletes objects of finished trials on a
later tick, once status says so). Every step is safe to repeat.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from batchtune.api import MAX_TRIAL_INDEX, LoadStepRecord, Setting, TrialPrediction, TrialRecord
from batchtune.controller import guidance, records
from batchtune.controller.ports import Owned
from batchtune.controller.tick import Target, Tick
from batchtune.core import measurement, trial_loop
from batchtune.core.gpus import TrialDevices, eligible_nodes, node_usage, trials_that_fit
from batchtune.core.guidance import TwinAdvice
from batchtune.core.manifests import (
    build_bench_job,
    build_load_job,
    build_trial_deployment,
    load_job_name,
    load_profile,
    trial_name,
)
from batchtune.core.pods import TrialFailure, classify_pod, load_message, log_wanted, owned_trial_pods, pod_is_ready
from batchtune.core.policy import gpu_minutes_budget
from batchtune.core.production import fingerprint
from batchtune.core.protocol import RunResult
from batchtune.core.search import Search
from batchtune.core.settings import Setting as CoreSetting
from batchtune.core.vocabulary import ConditionType, M, Phase, Reason, StepPurpose, TrialState, Verdict
from batchtune.prometheus import PrometheusUnavailable

# A load run whose data never shows up is run again this many times, then the trial is Failed.
MAX_MEASURE_ATTEMPTS = 3
# Failures that say the setting itself cannot work: the search prunes on them.
INFEASIBLE = frozenset({Reason.OOM_KILLED, Reason.OUT_OF_MEMORY, Reason.KV_CACHE_TOO_SMALL,
                        Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, Reason.ENGINE_REFUSED_ARGS,
                        Reason.CRASH_LOOP_BACK_OFF})


def trials(tick: Tick) -> None:
    # The budget first: a missing or unreadable target must not let trials hold their GPUs past it.
    budget = gpu_minutes_budget(tick.view.spec.strategy.max_gpu_minutes, tick.ports.install.max_gpu_minutes)
    if records.gpu_minutes_spent(tick.status, tick.now) >= budget:
        stop_at_budget(tick, budget)
        conclude_trialing(tick, budget, exhausted=True, strategy_done=True)
        return
    target = tick.target()
    if target is None:
        return
    if tick.status.baseline and tick.status.baseline.fingerprint != fingerprint(target.container):
        tick.target_changed(target)
        return
    devices = tick.devices(target)
    if devices is None:
        return
    owned = tick.ports.cluster.owned(tick.tuning.namespace, tick.tuning.uid)
    for trial in tick.status.trials:
        if trial.state in (TrialState.PENDING, TrialState.DEPLOYING):
            deploying(tick, target, trial, owned)
        elif trial.state in (TrialState.WARMING, TrialState.MEASURING):
            measuring(tick, target, trial, owned)
    exhausted = records.gpu_minutes_spent(tick.status, tick.now) >= budget
    if exhausted:
        stop_at_budget(tick, budget)
    if not exhausted and counter_spent(tick):
        return
    strategy_done = False if exhausted else launch(tick, target, owned, devices)
    conclude_trialing(tick, budget, exhausted, strategy_done)


def conclude_trialing(tick: Tick, budget: int, exhausted: bool, strategy_done: bool) -> None:
    """The budget's figure and the trial counts into status; on to Selecting once no trial runs and none is due."""
    # Whole minutes in status: a figure that moves every tick would cost a status write every tick.
    tick.status.gpu_minutes = float(math.floor(records.gpu_minutes_spent(tick.status, tick.now)))
    finished = [t for t in tick.status.trials if t.state.finished]
    tick.status.trials_completed = len(finished)
    active = [t for t in tick.status.trials if not t.state.finished]
    if not active and (exhausted or strategy_done or len(tick.status.trials) >= tick.status.trials_planned):
        why = f"{len(finished)} trials finished" + (f"; GPU budget of {budget} GPU-minutes reached" if exhausted else "")
        tick.set_phase(Phase.SELECTING, Reason.GPU_BUDGET_EXHAUSTED if exhausted else Reason.TRIALS_DONE, why)
        if exhausted:
            tick.event(True, Reason.GPU_BUDGET_EXHAUSTED, why)


def stop_at_budget(tick: Tick, budget: float) -> None:
    """The GPU budget is spent: trials whose search is done conclude (their curve step unmeasured), others fail."""
    message = (f"the tuning reached its GPU budget of {budget} GPU-minutes (spec.strategy.maxGpuMinutes, "
               "capped by the install)")
    for trial in tick.status.trials:
        if trial.state.finished:
            continue
        plan = trial_plan(tick, trial)
        if not trial_loop.search_done(plan, records.steps_of(trial)):
            tick.finish(trial, TrialState.FAILED, Reason.GPU_BUDGET_EXHAUSTED, message, Verdict.UNKNOWN)
            continue
        pending = next((s for s in trial.steps if s.purpose is StepPurpose.CURVE and s.verdict is None), None)
        if pending is None and plan.curve is not None:
            pending = LoadStepRecord(load=plan.curve.load, purpose=StepPurpose.CURVE)  # why it is missing
            trial.steps.append(pending)
        if pending is None:
            conclude(tick, trial)
            continue
        give_up_curve(tick, trial, pending, f"{Reason.GPU_BUDGET_EXHAUSTED.value}: {message}")


# ---- starting trials -----------------------------------------------------------------------------


def launch(tick: Tick, target: Target, owned: Owned, devices: TrialDevices) -> bool:
    """Start trials while slots, GPUs and the search allow; True when the search has nothing more to ask."""
    trials_ = tick.status.trials
    active = [t for t in trials_ if not t.state.finished]
    budget = tick.status.trials_planned - len(trials_)
    slots = min(tick.view.spec.strategy.max_parallel_trials - len(active), budget)
    if slots <= 0:
        return budget <= 0
    per_trial = devices.count
    if per_trial:
        fit = gpus_free_for(tick, target, devices, owned)
        if fit is not None:
            slots = min(slots, fit)
            if slots <= 0:
                tick.waiting(Reason.WAITING_FOR_GPUS,
                             f"No node has {per_trial} free {devices.resource} for the next trial"
                             + (f" (product {tick.status.plan.gpu_product})" if tick.status.plan and
                                tick.status.plan.gpu_product else "") + "; waiting")
                return False
    if (tick.status.round or 1) > 1 and not any(t.current for t in trials_):
        start_trial(tick, records.current_setting(tick.status, target.engine), per_trial, current=True)
        slots -= 1
        if slots <= 0:
            return False
    the_search = search(tick)
    as_candidate = records.current_is_candidate(tick.status, tick.view, target.engine, target.container)
    advice = None
    for _ in range(slots):
        done, pending = records.history(trials_, tick.view.objective, as_candidate)
        if tick.view.spec.strategy.kind == guidance.KIND:
            advice = guidance.advice(tick, target, the_search, done)
            if advice is None:
                return False  # the twin is calibrating and searching; a later tick asks again
            the_search = search(tick, advice)
        setting = the_search.ask(done, pending)
        if setting is None:
            return not pending
        trial = start_trial(tick, setting, per_trial,
                            prediction=records.prediction(advice, setting) if advice is not None else None)
        progressing = tick.status.condition(ConditionType.PROGRESSING)
        if progressing is not None and progressing.reason == Reason.TWIN_SEARCHING:
            tick.condition(ConditionType.PROGRESSING, True, Reason.TRIAL_STARTED, f"Trial {trial.name}: {setting.label()}")
    return False


def counter_spent(tick: Tick) -> bool:
    """The trial counter has no index left for the trials still to start (only a forged counter gets here): Failed."""
    if tick.status.next_trial_index + tick.status.trials_planned - len(tick.status.trials) <= MAX_TRIAL_INDEX:
        return False
    tick.fail(Reason.STATUS_UNREADABLE, f"status.nextTrialIndex {tick.status.next_trial_index} leaves no trial index "
                                        f"up to {MAX_TRIAL_INDEX}; edit the spec to start afresh")
    return True


def search(tick: Tick, advice: TwinAdvice | None = None) -> Search:
    """The strategy rebuilt from spec and status alone (pure), so a restarted operator asks the same.

    `advice`: the calibrated twin's, as status holds it (strategy TwinGuided)."""
    engine = tick.engine_named(tick.status.baseline.engine if tick.status.baseline else None)
    limits = records.engine_limits(tick.status.plan)
    spec = tick.view.spec
    return Search.start(spec.strategy.kind, spec.space, lambda s: engine.invariant_violation(s, limits),
                        records.pruned(tick.status), spec.slo, spec.objective, spec.strategy.seed,
                        spec.strategy.max_trials, advice)


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


def gpus_free_for(tick: Tick, target: Target, devices: TrialDevices, owned: Owned) -> int | None:
    """How many more trials fit on production's kind of node; None when this install cannot see nodes."""
    cluster = tick.ports.cluster
    nodes = cluster.nodes()
    pods = cluster.gpu_pods()
    if nodes is None or pods is None:
        return None
    product = tick.status.plan.gpu_product if tick.status.plan else None
    eligible = eligible_nodes(nodes, target.pod_spec.get("nodeSelector") or {}, product, devices.resource)
    usage, unbound = node_usage(eligible, pods, devices.resource)
    # Our own trials decided but not created yet hold GPUs as much as pods do.
    ours = [t.gpus for t in tick.status.trials if t.state is TrialState.DEPLOYING and t.gpus
            and t.name not in owned.deployments]
    return trials_that_fit(usage, unbound + ours + cluster.gpu_intents(tick.tuning.uid), devices.count)


def deploying(tick: Tick, target: Target, trial: TrialRecord, owned: Owned) -> None:
    if trial.name not in owned.deployments:
        services = [s.get("spec", {}).get("selector") or {} for s in tick.ports.cluster.services(tick.tuning.namespace)]
        manifest = build_trial_deployment(
            target.engine, target.deployment, target.container, tick.tuning.name, tick.tuning.uid,
            tick.tuning.namespace, trial.index, trial.setting.core(), tick.view.spec.extra_args,
            services, tick.status.plan.gpu_product if tick.status.plan else None, as_is=bool(trial.current))
        if tick.ports.cluster.create(manifest):
            tick.log.info("Created trial Deployment %s", trial.name)
        return
    pod = trial_pod(tick, trial, owned)
    readiness = tick.view.spec.trial.readiness_timeout_seconds
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


def trial_pod(tick: Tick, trial: TrialRecord, owned: Owned) -> Mapping[str, Any] | None:
    """The trial Deployment's own newest live pod: one that only carries its labels is never judged or targeted."""
    cluster, namespace = tick.ports.cluster, tick.tuning.namespace
    deployment_uid = (owned.deployments.get(trial.name) or {}).get("uid")
    pods = owned_trial_pods(cluster.trial_pods(namespace, tick.tuning.name, trial.index), deployment_uid,
                            lambda name, uid: cluster.replica_set_controller(namespace, name, uid))
    # A pod the node rejected (phase Failed) is replaced by its ReplicaSet; never judge by it.
    pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "") if pods else None


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
    tick.finish(trial, TrialState.INFEASIBLE if infeasible else TrialState.FAILED, failure.reason, failure.message,
                Verdict.VIOLATED if infeasible else Verdict.UNKNOWN)
    tick.event(True, Reason.TRIAL_INFEASIBLE if infeasible else Reason.TRIAL_FAILED,
               f"Trial {trial.name} ({trial.setting.summary()}): {failure.reason.value}: {failure.message}")


# ---- a trial's load runs: the trial loop, one run per few ticks --------------------------------------------


def trial_plan(tick: Tick, trial: TrialRecord) -> trial_loop.TrialPlan:
    """What the trial loop decides this trial's runs on, from the tick's view and status."""
    return trial_loop.TrialPlan(
        trial.setting.core(), tick.view.protocol, tick.view.windows,
        tuple(records.neighbours(tick.status.trials, trial)), records.curve_of(tick.status.plan),
        trial.prediction.capacity_load if trial.prediction is not None else None)


def measuring(tick: Tick, target: Target, trial: TrialRecord, owned: Owned) -> None:
    pod = trial_pod(tick, trial, owned)
    current = next((s for s in trial.steps if s.verdict is None), None)
    if pod is None or not pod_is_ready(pod):
        failure = classify_pod(pod, str(target.container["name"]), tick.now, 0, target.engine,
                               log=engine_log(tick, target, pod)) if pod else None
        failure = failure or TrialFailure(Reason.TRIAL_POD_LOST, "the trial pod stopped being ready under load")
        if current is not None and current.purpose is StepPurpose.CURVE:
            give_up_curve(tick, trial, current, f"the trial pod failed at the common load: "
                                                f"{failure.reason.value}: {failure.message}")
        else:
            failed(tick, trial, failure)
        return
    plan = trial_plan(tick, trial)
    if current is None:
        upcoming = trial_loop.next_step(plan, records.steps_of(trial))
        if upcoming is None:
            conclude(tick, trial)
            return
        current = records.step_record(upcoming)
        trial.steps.append(current)
    index = trial.steps.index(current)
    name = load_job_name(tick.tuning.name, trial.index, index, current.repeat, current.attempt)
    if current.job != name:
        current.job = name
        return  # intent first; the Job is created on the next tick
    job = owned.jobs.get(name)
    if job is None:
        create_load_job(tick, target, trial, trial_loop.run_of(plan, records.steps_of(trial), index), name, pod)
        trial.state = TrialState.WARMING
        return
    result = read_run(tick, target, trial, current, job, pod)
    if result is None:
        return
    steps, recorded = trial_loop.record(plan, records.steps_of(trial), index, records.as_stored(result))
    records.write_step(current, steps[index])
    if recorded is trial_loop.Recorded.LENGTHENED:
        current.attempt += 1
        samples = result.metrics.get(M.SAMPLES)
        tick.log.info("Trial %s: %s requests in the window at load %d; measuring %ds", trial.name,
                      "no" if not samples else int(samples), current.load, current.measure_seconds)
    elif recorded is trial_loop.Recorded.REPEAT:
        current.repeat += 1
        current.attempt = 0
    elif trial_loop.next_step(plan, steps) is None:
        conclude(tick, trial)  # the verdict in this tick, not the next


def read_run(tick: Tick, target: Target, trial: TrialRecord, current: LoadStepRecord, job: Mapping[str, Any],
             pod: Mapping[str, Any]) -> RunResult | None:
    """The finished load run's figures, or None while it runs, while Prometheus is incomplete or after a retry."""
    spec = tick.view.spec
    install = tick.ports.install
    run = tick.ports.cluster.job_run(tick.tuning.namespace, job)
    if not run.finished:
        tick.load_run_going = True
        if run.started and run.started + timedelta(seconds=spec.trial.warmup_seconds) < tick.now:
            trial.state = TrialState.MEASURING
        return None
    message = load_message(run.pods, job.get("uid"))
    if run.failed:
        retry(tick, trial, current, Reason.LOAD_GENERATOR_FAILED,
              f"the load generator failed: {(message or 'no termination message')[:300]}")
        return None
    summary = _summary(message)
    window = measurement.measurement_window(summary, run.started, run.ended, spec.trial.warmup_seconds)
    if window is None:
        retry(tick, trial, current, Reason.MEASUREMENT_UNAVAILABLE, "the load run has no measurement window")
        return None
    interval = tick.scrape_interval()
    short = measurement.window_too_short((window.end - window.start).total_seconds(), interval.seconds,
                                         "spec.load.numPrompts" if spec.load.num_prompts else
                                         "spec.trial.bracketSeconds" if current.purpose is StepPurpose.BRACKET else
                                         "spec.trial.measureSeconds", interval.source)
    if short:
        give_up(tick, trial, current, Reason.MEASUREMENT_WINDOW_TOO_SHORT, short)
        return None
    complete = window.end + timedelta(seconds=install.scrape_lag_seconds)
    if complete > tick.now:
        tick.wake(complete)  # the verdict is taken when the window is complete, not on the timer's next run
        return None  # Prometheus needs a scrape or two after the run before its window is complete
    try:
        values = tick.reader(target.engine).trial_run(tick.tuning.namespace, str(pod["metadata"]["name"]),
                                                      tick.status.plan.served_model if tick.status.plan else None,
                                                      window)
    except PrometheusUnavailable as exc:
        # Keep the Job: its window stays in Prometheus' storage for when it comes back, up to a deadline.
        tick.prometheus_down(exc)
        current.unavailable_since = current.unavailable_since or tick.now
        if tick.now - current.unavailable_since > timedelta(seconds=install.measurement_deadline_seconds):
            give_up(tick, trial, current, Reason.MEASUREMENT_UNAVAILABLE,
                    f"Prometheus did not give this run's figures for {install.measurement_deadline_seconds}s: {exc}")
        return None
    tick.prometheus_ok()
    current.unavailable_since = None
    gaps = measurement.missing(values, tuple(tick.view.slo.latency_targets()) if not summary else ())
    if gaps:
        retry(tick, trial, current, Reason.MEASUREMENT_UNAVAILABLE, "no complete data in Prometheus for "
              + ", ".join(gaps))
        return None
    return measurement.run_result(values, summary, tick.view.slo.percentile)


def create_load_job(tick: Tick, target: Target, trial: TrialRecord, run: trial_loop.Run, name: str,
                    pod: Mapping[str, Any]) -> None:
    """The load Job for one run, aimed at the trial Deployment's own pod (`pod`), never at an address status holds."""
    plan, spec = tick.status.plan, tick.view.spec
    limits = plan.engine_limits if plan else None
    profile = load_profile(tick.view, run, spec.strategy.seed + trial.index * 1000 + len(trial.steps),
                           records.curve_of(plan), limits.max_model_len if limits else None)
    model = plan.served_model if plan and plan.served_model else ""
    trial.pod_ip = (pod.get("status") or {}).get("podIP")
    trial.port = target.engine.serving_port(target.container)
    base_url = f"http://{trial.pod_ip}:{trial.port}"
    operator_image = tick.ports.install.operator_image
    if not spec.load.builtin_generator:
        job = build_bench_job(target.engine, tick.tuning.name, tick.tuning.uid, tick.tuning.namespace, trial.index,
                              name, image=spec.load.image or str(target.container.get("image", "")),
                              operator_image=operator_image, base_url=base_url, model=model,
                              tokenizer=plan.model if plan else None, profile=profile)
    else:
        job = build_load_job(tick.tuning.name, tick.tuning.uid, tick.tuning.namespace, trial.index, name,
                             image=spec.load.image or operator_image, base_url=base_url, model=model, profile=profile)
    tick.ports.cluster.create(job)


def retry(tick: Tick, trial: TrialRecord, step: LoadStepRecord, reason: Reason, message: str) -> None:
    """Run the load again as a new Job (the old one is garbage), up to MAX_MEASURE_ATTEMPTS failed ones."""
    step.attempt += 1
    tick.log.warning("Trial %s: %s; attempt %d", trial.name, message, step.attempt)
    if step.attempt - step.lengthened >= MAX_MEASURE_ATTEMPTS:
        give_up(tick, trial, step, reason, f"{MAX_MEASURE_ATTEMPTS} attempts: {message}")


def give_up(tick: Tick, trial: TrialRecord, step: LoadStepRecord, reason: Reason, message: str) -> None:
    """A step that cannot be measured fails its trial; the curve step only goes unmeasured (the search's
    conclusion stands without it)."""
    if step.purpose is StepPurpose.CURVE:
        give_up_curve(tick, trial, step, f"{reason.value}: {message}")
    else:
        tick.finish(trial, TrialState.FAILED, reason, message, Verdict.UNKNOWN)


def give_up_curve(tick: Tick, trial: TrialRecord, step: LoadStepRecord, why: str) -> None:
    """The curve step is closed unmeasured (its Job becomes garbage) and the trial concludes from its search."""
    index = trial.steps.index(step)
    records.write_step(step, trial_loop.give_up_curve(records.steps_of(trial), index, why)[index])
    tick.log.warning("Trial %s: no reading at the common curve load: %s", trial.name, why)
    conclude(tick, trial)


def conclude(tick: Tick, trial: TrialRecord) -> None:
    concluded = trial_loop.conclude(trial_plan(tick, trial), records.steps_of(trial))
    conclusion = concluded.conclusion
    if trial.curve_step is None:
        trial.curve_step = concluded.curve_step
    trial.metrics = dict(conclusion.metrics)
    tick.finish(trial, TrialState.DONE, conclusion.reason, conclusion.message, conclusion.verdict,
                conclusion.verdict_reason)
    tick.event(False, Reason.TRIAL_COMPLETED, f"Trial {trial.name} ({trial.setting.summary()}): "
                                              f"{conclusion.verdict.value}: {conclusion.verdict_reason}")


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
