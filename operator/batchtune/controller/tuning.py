"""The reconcile's vocabulary over the pure core and the twin: status dicts in, status dicts out.

Everything here is pure except the functions that take a `Prometheus` (they only query it).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from batchtune import core
from batchtune.api.models import BatchTuningSpec, ObjectiveType
from batchtune.controller import report as report_mod
from batchtune.controller.failures import FailureReason, TrialFailure
from batchtune.controller.loadsearch import LoadStep
from batchtune.controller.prom import Prometheus

ArgsError = core.ArgsError
UnsafeShell = core.UnsafeShell
GPU_RESOURCE = "nvidia.com/gpu"
# Loadgen and Prometheus disagreeing by more than this (relative) is reported on the trial.
CROSS_CHECK_TOLERANCE = 0.25
# Infeasible reasons the strategies prune on (core vocabulary) for the classifier's reasons.
_CORE_REASONS = {
    FailureReason.OOM_KILLED.value: core.REASON_OUT_OF_MEMORY,
    FailureReason.KV_CACHE_DOES_NOT_FIT.value: core.REASON_KV_CACHE_TOO_SMALL,
    FailureReason.INSUFFICIENT_GPU_MEMORY.value: core.REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH,
}


# ---- target and baseline -------------------------------------------------------------------

def find_vllm_container(target: Mapping[str, Any], name: str | None) -> dict:
    pod_spec = ((target.get("spec") or {}).get("template") or {}).get("spec") or {}
    return core.find_vllm_container(pod_spec, name)


def read_baseline(container: Mapping[str, Any]) -> core.VllmInvocation:
    return core.read_vllm_settings(container)


def baseline_status(baseline: core.VllmInvocation) -> dict:
    out = {"args": flat_args({"command": None, "args": list(baseline.args)})}
    for key, value in (("maxNumSeqs", baseline.max_num_seqs),
                       ("gpuMemoryUtilizationPercent", baseline.gpu_memory_utilization_percent),
                       ("maxNumBatchedTokens", baseline.max_num_batched_tokens)):
        if value is not None:
            out[key] = value
    return out


def flat_args(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in (container.get("command") or [])] + [str(a) for a in (container.get("args") or [])]


def setting_label(setting: Mapping[str, Any]) -> str:
    return core.Setting.from_status(setting).label()


def gpus_per_trial(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(GPU_RESOURCE)
    return int(value) if value else 0


def serving_port(container: Mapping[str, Any]) -> int:
    return core.vllm_port(container)


def rollout_complete(deployment: Mapping[str, Any]) -> bool:
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    replicas = spec.get("replicas", 1)
    return (status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
            and status.get("updatedReplicas", 0) == replicas
            and status.get("availableReplicas", 0) >= replicas
            and status.get("replicas", 0) == replicas)


# ---- planning ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrialPlan:
    candidates: tuple[core.Setting, ...]
    pruned: tuple[core.PrunedSetting, ...]
    notes: tuple[str, ...]

    def summary(self) -> str:
        text = f"{len(self.candidates)} candidates, {len(self.pruned)} pruned"
        reasons = sorted({p.reason for p in self.pruned})
        if reasons:
            text += " (" + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "") + ")"
        return text


def memory_fit(baseline: core.VllmInvocation, gpu_product: str | None) -> tuple[core.FitCheck | None, str]:
    """The twin's memory model as a prefilter, or None (with why) when the GPU or model is unknown."""
    from batchtune.twin.catalog import UnknownGpu, UnknownModel, gpu_from_product_label
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.memory import StartupFailure, plan_memory

    if not gpu_product:
        return None, "GPU model unknown (no nvidia.com/gpu.product label on the target's nodes): memory prefilter skipped"
    try:
        gpu = gpu_from_product_label(gpu_product)
        base = ServeConfig.from_vllm_argv(["vllm", "serve", *baseline.args] if baseline.form != "api_server"
                                          else list(baseline.args), gpu)
    except (UnknownGpu, UnknownModel, ValueError, TypeError) as exc:
        return None, f"memory prefilter skipped: {exc}"

    def fits(setting: core.Setting) -> core.FitVerdict:
        cfg = base.replace(max_num_seqs=setting.max_num_seqs,
                           gpu_memory_utilization=setting.gpu_memory_utilization_percent / 100,
                           **({"max_num_batched_tokens": setting.max_num_batched_tokens}
                              if setting.max_num_batched_tokens else {}))
        try:
            plan = plan_memory(cfg)
        except StartupFailure as exc:
            return core.FitVerdict(False, str(exc).splitlines()[-1][:300])
        return core.FitVerdict(True, f"KV cache {plan.kv_cache_tokens} tokens on {gpu.name}")

    return fits, f"memory prefilter: twin model of {base.model.name} on {gpu.name}"


def make_plan(spec: BatchTuningSpec, baseline: core.VllmInvocation, gpu_product: str | None) -> TrialPlan:
    fits, note = memory_fit(baseline, gpu_product)
    plan = core.plan_candidates(core.SearchSpace.from_spec(spec.search_space),
                                core.EngineLimits.from_flags(dict(baseline.flags)), fits)
    return TrialPlan(plan.candidates, plan.pruned, (note,) + tuple(plan.notes))


def engine_limits_status(baseline: core.VllmInvocation) -> dict:
    limits = core.EngineLimits.from_flags(dict(baseline.flags))
    out = {"chunkedPrefill": limits.chunked_prefill}
    if limits.max_model_len is not None:
        out["maxModelLen"] = limits.max_model_len
    if limits.max_num_batched_tokens is not None:
        out["maxNumBatchedTokens"] = limits.max_num_batched_tokens
    return out


def pruned_status(plan: TrialPlan) -> list[dict]:
    return [p.to_status() for p in plan.pruned[:200]]


def _core_plan(spec: BatchTuningSpec, plan_status: Mapping[str, Any], baseline: Mapping[str, Any],
               pruned: Sequence[Mapping[str, Any]]) -> tuple[core.Plan, list[core.HistoryEntry]]:
    """The plan again from spec and status alone (pure), so a restarted operator asks the same.

    Settings the memory prefilter pruned stay in the plan and enter the history as Infeasible
    with vLLM's memory reason: to a strategy they are what a failed trial would have taught it
    (a column cut short by memory is KV-bound), learned without spending a GPU.
    """
    space = core.SearchSpace.from_spec(spec.search_space)
    saved = plan_status.get("engineLimits") or {}
    limits = core.EngineLimits(saved.get("maxModelLen"), saved.get("chunkedPrefill", True),
                               saved.get("maxNumBatchedTokens"))
    plan = core.plan_candidates(space, limits)
    learned = []
    for entry in pruned:
        reason = _memory_reason(entry.get("reason") or "")
        setting = core.Setting.from_status(entry["setting"])
        if reason and setting in plan.candidates:
            learned.append((setting, core.TrialOutcome(state="Infeasible", verdict="Violated", reason=reason,
                                                       message=entry["reason"])))
    return plan, learned


def _memory_reason(text: str) -> str | None:
    if not text.startswith("does not fit in GPU memory"):
        return None
    if "Free memory on device" in text:
        return core.REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH
    return core.REASON_KV_CACHE_TOO_SMALL


def history(trials: Sequence[Mapping[str, Any]]) -> tuple[list[core.HistoryEntry], list[core.Setting]]:
    """Finished trials as (Setting, TrialOutcome) in trial order, and the settings still running."""
    done, pending = [], []
    for t in trials:
        setting = core.Setting.from_status(t["setting"])
        if t["state"] in ("Done", "Infeasible", "Failed"):
            done.append((setting, outcome_of(t)))
        else:
            pending.append(setting)
    return done, pending


def outcome_of(trial: Mapping[str, Any]) -> core.TrialOutcome:
    metrics = {k: v for k, v in (trial.get("metrics") or {}).items() if isinstance(v, (int, float))}
    reason = _CORE_REASONS.get(trial.get("reason") or "", trial.get("reason") or "")
    return core.TrialOutcome(state=trial["state"], verdict=trial.get("verdict") or "Unknown",
                             metrics=metrics, reason=reason, message=trial.get("message") or "")


def next_setting(spec: BatchTuningSpec, plan_status: Mapping[str, Any], baseline: Mapping[str, Any],
                 trials: Sequence[Mapping[str, Any]], pruned: Sequence[Mapping[str, Any]] = ()) -> dict | None:
    plan, learned = _core_plan(spec, plan_status, baseline, pruned)
    # What the prefilter taught is history too, but it spends none of spec.strategy.maxTrials.
    strategy = core.make_strategy(spec.strategy.type.value, plan, core.SloTargets.from_spec(spec.slo),
                                  spec.objective.type.value, spec.strategy.seed,
                                  spec.strategy.max_trials + len(learned))
    done, pending = history(trials)
    setting = strategy.ask(learned + done, pending)
    return setting.to_status() if setting is not None else None


# ---- trial objects -------------------------------------------------------------------------

def trial_name(bt_name: str, index: int) -> str:
    return core.trial_name(bt_name, index)


def trial_pod_selector(bt_name: str, index: int) -> str:
    from batchtune.core.manifests import label_value

    return (f"{core.LABEL_TUNING}={label_value(bt_name)},{core.LABEL_TRIAL}={index},"
            f"{core.LABEL_COMPONENT}=trial")


def owner_reference(bt_name: str, bt_uid: str) -> dict:
    return core.owner_reference(bt_name, bt_uid)


def trial_deployment(spec: BatchTuningSpec, target: Mapping[str, Any], container: Mapping[str, Any],
                     bt_name: str, bt_uid: str, namespace: str, trial: Mapping[str, Any]) -> dict:
    return core.build_trial_deployment(target, bt_name, bt_uid, namespace, trial["index"],
                                       core.Setting.from_status(trial["setting"]),
                                       tuple(spec.search_space.extra_args or ()), container["name"])


def readiness_timeout(spec: BatchTuningSpec) -> TrialFailure:
    return TrialFailure(FailureReason.READINESS_TIMEOUT,
                        f"no ready pod after {spec.trial.readiness_timeout_seconds}s "
                        "(spec.trial.readinessTimeoutSeconds)")


def job_name(trial: str, step: int, repeat: int, attempt: int) -> str:
    return f"{trial}-s{step}r{repeat}a{attempt}"


def load_job(spec: BatchTuningSpec, status: Mapping[str, Any], bt_name: str, bt_uid: str, namespace: str,
             trial: Mapping[str, Any], step: Mapping[str, Any], name: str, operator_image: str,
             target_image: str, model: str) -> dict:
    seqs = trial["setting"]["maxNumSeqs"]
    profile = core.load_profile_from_spec(spec, seqs)
    workload = status.get("workload") or {}
    changes: dict[str, Any] = {}
    if workload.get("inputTokens"):
        changes.update(input_tokens=workload["inputTokens"], output_tokens=workload["outputTokens"])
    if open_loop(spec):
        changes.update(requests_per_minute=step["load"], concurrency=None)
    else:
        changes.update(concurrency=step["load"], requests_per_minute=None)
    profile = core.LoadProfile(**{**profile.__dict__, **changes})
    generator = spec.load.generator.value
    image = spec.load.image or (operator_image if generator == "Builtin" else target_image)
    base_url = f"http://{trial['podIP']}:{trial['port']}"
    job = core.build_load_job(bt_name, bt_uid, namespace, trial["index"], generator=generator, image=image,
                              base_url=base_url, model=model, profile=profile, repeat=step.get("repeat", 0))
    job["metadata"]["name"] = name
    return job


def job_state(job: Mapping[str, Any]) -> tuple[bool, bool, str | None, str | None]:
    """(finished, failed, startTime, end time) of a Job."""
    status = job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    failed = "Failed" in conditions
    done = failed or "Complete" in conditions or bool(status.get("succeeded"))
    end = status.get("completionTime") or (conditions.get("Failed") or conditions.get("Complete") or {}).get(
        "lastTransitionTime")
    return done, failed, status.get("startTime"), end


def job_message(namespace: str, job: Mapping[str, Any]) -> str:
    message = _termination_message(namespace, job)
    return (message or "no termination message")[:500]


def _termination_message(namespace: str, job: Mapping[str, Any]) -> str | None:
    from batchtune.controller import kube

    for pod in kube.list_pods(namespace, f"job-name={job['metadata']['name']}"):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or {}
            if terminated.get("message"):
                return terminated["message"]
    return None


def loadgen_summary(namespace: str, job: Mapping[str, Any]) -> dict | None:
    text = _termination_message(namespace, job)
    if not text:
        return None
    try:
        summary = json.loads(text)
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None


# ---- measurement ---------------------------------------------------------------------------

# The metrics a step needs before any decision: latency at the SLO percentile and throughput.
REQUIRED = ("requestThroughput", "outputThroughput")


@dataclass
class Measurement:
    values: dict[str, float | None] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.missing


def measure_trial(prom: Prometheus, spec: BatchTuningSpec, namespace: str, pod: str, model: str | None,
                  start: datetime, end: datetime) -> Measurement:
    window = max(1, int((end - start).total_seconds()))
    queries = core.trial_queries(
        namespace=namespace, pod=pod, model=model, window_s=window,
        percentile=int(spec.slo.percentile.value.lstrip("P")),
        names=core.MetricNames.from_spec(spec.prometheus.metric_names),
        labels=core.LabelNames.from_spec(spec.prometheus.labels),
        gpu_labels=core.LabelNames.from_spec(spec.prometheus.gpu_labels, with_model=False))
    at = end.timestamp()
    values = {name: prom.scalar(q, at) for name, q in queries.items()}
    needed = list(REQUIRED) + list(core.SloTargets.from_spec(spec.slo).latency_targets())
    return Measurement(values, [n for n in needed if values.get(n) is None])


# vLLM's latency histograms are coarse (ITL buckets 10, 25, 50, 75 ms; e2e from 300 ms), so an
# interpolated p95 can sit tens of percent off. The load generator's exact client-side percentiles
# decide the SLO when it reported them; the histogram values stay beside them for the record.
_CLIENT_LATENCIES = (("itlMs", "itl"), ("ttftMs", "ttft"), ("e2eMs", "e2el"))


def step_result(measurement: Measurement, summary: Mapping[str, Any] | None, percentile: int) -> dict:
    """One load run's metrics: Prometheus for rates and GPU signals, client-side latency percentiles."""
    values = {k: v for k, v in measurement.values.items() if v is not None}
    notes = []
    if summary:
        completed, failed = summary.get("completed") or 0, summary.get("failed") or 0
        if completed + failed > 0:
            values["errorRatePercent"] = 100.0 * failed / (completed + failed)
        for ours, key in _CLIENT_LATENCIES:
            client = summary.get(f"p{percentile}_{key}_ms")
            if isinstance(client, (int, float)) and math.isfinite(client):
                histogram = values.get(ours)
                if histogram is not None:
                    values[f"{ours[:-2]}HistogramMs"] = histogram
                values[ours] = float(client)
        pairs = (("requestThroughput", "request_throughput"), ("outputThroughput", "output_throughput"),
                 ("itlHistogramMs", f"p{percentile}_itl_ms"), ("ttftHistogramMs", f"p{percentile}_ttft_ms"),
                 ("e2eHistogramMs", f"p{percentile}_e2el_ms"))
        for ours, theirs in pairs:
            a, b = values.get(ours), summary.get(theirs)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and max(a, b) > 0:
                gap = abs(a - b) / max(a, b)
                if gap > CROSS_CHECK_TOLERANCE:
                    notes.append(f"{ours}: Prometheus {a:.4g} vs load generator {b:.4g} ({gap:.0%} apart)")
    out: dict[str, Any] = {"metrics": values}
    if notes:
        out["crossCheck"] = "; ".join(notes)
    return out


def close_step(spec: BatchTuningSpec, step: dict) -> None:
    """Combine the repeats of a load step (worst case) and give it a verdict and an SLO margin."""
    results = step.get("results") or []
    combined = _worst_case([r["metrics"] for r in results])
    slo = core.SloTargets.from_spec(spec.slo)
    verdict = core.evaluate_slo(combined, slo)
    step["metrics"] = {k: round(v, 4) for k, v in combined.items()}
    step["verdict"] = verdict.verdict.value
    step["verdictReason"] = verdict.reason[:500]
    step["margin"] = round(slo_margin(combined, slo), 4)
    notes = [r["crossCheck"] for r in results if r.get("crossCheck")]
    if notes:
        step["crossCheck"] = notes[0][:500]


_HIGHER_IS_WORSE = ("ttftMs", "itlMs", "e2eMs", "queueMs", "errorRatePercent", "preemptionsPerSecond",
                    "kvCacheUsagePercent", "kvCacheUsageMaxPercent", "waitingRequests")


def _worst_case(samples: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    keys = {k for s in samples for k in s}
    out = {}
    for key in keys:
        values = [float(s[key]) for s in samples if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])]
        if not values:
            continue
        out[key] = max(values) if key in _HIGHER_IS_WORSE else (min(values) if "Throughput" in key
                                                                   else statistics.fmean(values))
    return out


def slo_margin(metrics: Mapping[str, Any], slo: core.SloTargets) -> float:
    """Worst relative margin under the headroom-adjusted limits; negative when a limit is exceeded."""
    margins = []
    for metric, target in slo.latency_targets().items():
        value = metrics.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            limit = slo.limit(target)
            margins.append((limit - value) / limit)
    return min(margins) if margins else float("-inf")


def open_loop(spec: BatchTuningSpec) -> bool:
    return spec.load.requests_per_minute is not None


def fixed_load(spec: BatchTuningSpec, trial: Mapping[str, Any], workload: Mapping[str, Any] | None) -> int:
    if open_loop(spec):
        return spec.load.requests_per_minute
    if workload and workload.get("requestsPerMinute") and spec.load.concurrency is None:
        return max(1, int(workload["requestsPerMinute"]))
    return spec.load.concurrency or trial["setting"]["maxNumSeqs"]


def capacity_start(spec: BatchTuningSpec, trial: Mapping[str, Any], trials: Sequence[Mapping[str, Any]]) -> int:
    """Warm start: the nearest finished trial's capacity load, scaled to this trial's max-num-seqs."""
    seqs = trial["setting"]["maxNumSeqs"]
    neighbours = []
    for other in trials:
        cap = (other.get("metrics") or {}).get("sloCapacityLoad")
        if other.get("state") == "Done" and cap:
            distance = abs(math.log2(other["setting"]["maxNumSeqs"] / seqs))
            neighbours.append((distance, other["setting"]["maxNumSeqs"], cap))
    if neighbours:
        _, their_seqs, cap = min(neighbours)
        scale = 1.0 if open_loop(spec) else min(seqs / their_seqs, 2.0)
        return max(1, int(cap * max(scale, 0.5)))
    if open_loop(spec):
        return spec.load.requests_per_minute
    return spec.load.concurrency or max(1, seqs // 2)


def capacity_ceiling(spec: BatchTuningSpec, trial: Mapping[str, Any]) -> int:
    # Closed-loop users past max-num-seqs only queue: twice the batch is enough to see it fail.
    return 10_000_000 if open_loop(spec) else max(2, trial["setting"]["maxNumSeqs"] * 2)


def as_load_step(step: Mapping[str, Any]) -> LoadStep:
    metrics = step.get("metrics") or {}
    return LoadStep(load=step["load"], passed=step.get("verdict") == "Met",
                    margin=float(step.get("margin", float("-inf"))),
                    throughput=float(metrics.get("requestThroughput") or 0.0))


@dataclass(frozen=True)
class TrialConclusion:
    metrics: dict
    verdict: str
    verdict_reason: str
    reason_code: str
    message: str


def trial_outcome(spec: BatchTuningSpec, steps: Sequence[Mapping[str, Any]]) -> TrialConclusion:
    measured = [s for s in steps if s.get("verdict")]
    if not measured:
        return TrialConclusion({}, "Unknown", "no load step was measured", "NotMeasured", "no load step was measured")
    if spec.objective.type != ObjectiveType.SLO_CAPACITY:
        step = measured[-1]
        metrics = dict(step.get("metrics") or {})
        _derived(metrics)
        _peaks(metrics, measured)
        return TrialConclusion(metrics, step["verdict"], step.get("verdictReason", ""), "Measured",
                               step.get("crossCheck") or f"measured at load {step['load']}")
    passing = [s for s in measured if s["verdict"] == "Met"]
    unknown = [s for s in measured if s["verdict"] == "Unknown"]
    if not passing:
        step = min(measured, key=lambda s: s["load"])
        metrics = dict(step.get("metrics") or {})
        _derived(metrics)
        _peaks(metrics, measured)
        verdict = "Unknown" if unknown and len(unknown) == len(measured) else "Violated"
        return TrialConclusion(metrics, verdict, f"even the lowest load ({step['load']}) fails: "
                               + step.get("verdictReason", ""), "NoCapacity", step.get("crossCheck") or "")
    best = max(passing, key=lambda s: s["load"])
    metrics = dict(best.get("metrics") or {})
    _derived(metrics)
    _peaks(metrics, measured)
    metrics["sloCapacity"] = metrics.get("requestThroughput")
    metrics["sloCapacityLoad"] = best["load"]
    unit = "requests/min" if open_loop(spec) else "concurrent requests"
    return TrialConclusion(metrics, "Met", f"SLO capacity {metrics.get('sloCapacity') or 0:.3g} req/s at "
                           f"{best['load']} {unit}: " + best.get("verdictReason", ""), "Measured",
                           best.get("crossCheck") or f"{len(measured)} load steps")


# Trial metric <- step metrics it is the peak of, over every measured step: the capacity step's own
# KV usage sits below where the cache binds, the failing step above it shows the binding (Adaptive's gmu gate).
_PEAKS = {"kvCacheUsagePeakPercent": ("kvCacheUsageMaxPercent", "kvCacheUsagePercent"),
          "preemptionsPeakPerSecond": ("preemptionsPerSecond",)}


def _peaks(metrics: dict, steps: Sequence[Mapping[str, Any]]) -> None:
    for peak, names in _PEAKS.items():
        values = [float(v) for s in steps for name in names
                  if isinstance(v := (s.get("metrics") or {}).get(name), (int, float)) and math.isfinite(v)]
        if values:
            metrics[peak] = max(values)


def _derived(metrics: dict) -> None:
    throughput, watts = metrics.get("outputThroughput"), metrics.get("powerWatts")
    if isinstance(throughput, (int, float)) and isinstance(watts, (int, float)) and watts > 0:
        metrics["tokensPerJoule"] = round(throughput / watts, 4)


# ---- selection and recommendation ----------------------------------------------------------

@dataclass
class TrialSelection:
    best: dict | None
    knee: dict | None
    reason: str
    trials: list[dict]


def select(spec: BatchTuningSpec, trials: Sequence[Mapping[str, Any]]) -> TrialSelection:
    completed = [core.CompletedTrial(t["name"], core.Setting.from_status(t["setting"]), outcome_of(t))
                 for t in trials]
    chosen = core.select_best(completed, spec.objective.type.value, core.SloTargets.from_spec(spec.slo))
    updated = []
    for t in trials:
        t = dict(t)
        verdict = chosen.verdicts.get(t["name"])
        if verdict:
            t["verdictReason"] = verdict[:1000]
        updated.append(t)
    best = next((t for t in updated if t["name"] == chosen.best_trial), None)
    reason = chosen.reason
    if best is None:
        if not any(t.get("state") == "Done" for t in trials):
            reason = f"{reason}: no trial finished a measurement (see each trial's reason)"
        else:
            reason = (f"{reason}: the SLO (spec.slo) is not met by any setting tried; "
                      "relax the targets or widen spec.searchSpace")
    return TrialSelection(best, chosen.knee.to_status() if chosen.knee else None, reason, updated)


def recommendation(spec: BatchTuningSpec, target: Mapping[str, Any], container: Mapping[str, Any],
                   selection: TrialSelection, replicas: int | None) -> dict:
    setting = core.Setting.from_status(selection.best["setting"])
    new = core.rewrite_vllm_args(container, setting)
    name = container["name"]
    containers = ((target["spec"]["template"].get("spec") or {}).get("containers") or [])
    index = next(i for i, c in enumerate(containers) if c.get("name") == name)
    ops = []
    for field_name in ("command", "args"):
        if new.get(field_name) != container.get(field_name):
            op = "replace" if field_name in container else "add"
            ops.append({"op": op, "path": f"/spec/template/spec/containers/{index}/{field_name}",
                        "value": new.get(field_name)})
    kustomize = {"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": target["metadata"]["name"]},
                 "spec": {"template": {"spec": {"containers": [
                     {"name": name, **{k: new[k] for k in ("command", "args") if k in new}}]}}}}
    import yaml

    helm = yaml.safe_dump({"vllm": {"maxNumSeqs": setting.max_num_seqs,
                                    "gpuMemoryUtilization": float(core.percent_to_fraction(
                                        setting.gpu_memory_utilization_percent)),
                                    **({"maxNumBatchedTokens": setting.max_num_batched_tokens}
                                       if setting.max_num_batched_tokens else {})},
                           "extraArgs": setting.as_args()}, sort_keys=False)
    out = {
        "setting": setting.to_status(),
        "args": flat_args(new),
        "reason": selection.reason[:2000],
        "jsonPatch": json.dumps(ops, indent=2),
        "kustomizePatch": yaml.safe_dump(kustomize, sort_keys=False),
        "helmValues": "# Values for charts that expose vLLM flags; adapt the keys to your chart.\n" + helm,
        "containerName": name,
        "container": {k: new[k] for k in ("command", "args") if new.get(k) is not None},
    }
    if replicas:
        out["replicasHint"] = replicas
    return out


def replicas_hint(prom: Prometheus, spec: BatchTuningSpec, namespace: str, pods: Sequence[str],
                  best: Mapping[str, Any]) -> int | None:
    """Replicas production needs at its observed peak request rate, with the SLO headroom kept."""
    capacity = (best.get("metrics") or {}).get("sloCapacity")
    if not pods or not capacity:
        return None
    names = core.MetricNames.from_spec(spec.prometheus.metric_names)
    selector = production_selector(spec, namespace, pods)
    peak = prom.scalar(f"max_over_time(sum(rate({names.request_success}{selector}[1m]))[1h:30s])")
    if peak is None or peak <= 0:
        return None
    usable = capacity * (100 - spec.slo.headroom_percent) / 100
    return max(1, math.ceil(peak / usable))


def production_selector(spec: BatchTuningSpec, namespace: str, pods: Sequence[str]) -> str:
    """`{namespace="..",pod=~"a|b"}` for production's pods (regex-escaped, then PromQL-escaped)."""
    labels = core.LabelNames.from_spec(spec.prometheus.labels, with_model=False)
    regex = "|".join(re.escape(p) for p in pods) or "^$"
    return (f'{{{labels.namespace}="{core.escape_label_value(namespace)}",'
            f'{labels.pod}=~"{core.escape_label_value(regex)}"}}')


def production_metrics(prom: Prometheus, spec: BatchTuningSpec, namespace: str, pods: Sequence[str],
                       start: datetime, end: datetime) -> dict:
    """Production's SLO metrics over a window (all its pods together)."""
    names = core.MetricNames.from_spec(spec.prometheus.metric_names)
    sel = production_selector(spec, namespace, pods)
    window = f"[{max(1, int((end - start).total_seconds()))}s]"
    q = int(spec.slo.percentile.value.lstrip("P")) / 100
    at = end.timestamp()

    def quantile(metric: str) -> float | None:
        value = prom.scalar(f"1000 * histogram_quantile({q:g}, sum by (le) (rate({metric}_bucket{sel}{window})))", at)
        return value

    out = {
        "ttftMs": quantile(names.time_to_first_token),
        "itlMs": quantile(names.inter_token_latency),
        "e2eMs": quantile(names.e2e_request_latency),
        "requestThroughput": prom.scalar(f"sum(rate({names.request_success}{sel}{window}))", at),
        "outputThroughput": prom.scalar(f"sum(rate({names.generation_tokens}{sel}{window}))", at),
        "waitingRequests": prom.scalar(f"sum(avg_over_time({names.num_requests_waiting}{sel}{window}))", at),
    }
    aborted = prom.scalar(f'sum(rate({names.request_success}{sel[:-1]},finished_reason="abort"}}{window}))', at)
    if out["requestThroughput"]:
        out["errorRatePercent"] = 100.0 * (aborted or 0.0) / out["requestThroughput"]
    elif out["requestThroughput"] == 0.0:
        out["errorRatePercent"] = 0.0
    return {k: (round(v, 4) if v is not None else None) for k, v in out.items()}


def production_workload(prom: Prometheus, spec: BatchTuningSpec, namespace: str, pods: Sequence[str]) -> dict | None:
    """Mean prompt and output lengths and the request rate production served over the last hour."""
    sel = production_selector(spec, namespace, pods)
    if not pods:
        return None
    prompt = prom.scalar(f"sum(rate(vllm:request_prompt_tokens_sum{sel}[1h])) / "
                         f"sum(rate(vllm:request_prompt_tokens_count{sel}[1h]))")
    output = prom.scalar(f"sum(rate(vllm:request_generation_tokens_sum{sel}[1h])) / "
                         f"sum(rate(vllm:request_generation_tokens_count{sel}[1h]))")
    rate = prom.scalar(f"sum(rate(vllm:request_success_total{sel}[1h]))")
    if prompt is None or output is None:
        return None
    out = {"inputTokens": max(1, round(prompt)), "outputTokens": max(1, round(output)), "source": "production"}
    if rate:
        out["requestsPerMinute"] = max(1, round(rate * 60))
    return out


# Mean waiting requests over the verify window above which production is short of capacity.
QUEUED_REQUESTS = 0.5


def verify_verdict(spec: BatchTuningSpec, before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[str, str]:
    """Production after the change against production before it, both from vLLM's histograms.

    A latency counts as a regression when it breaks its SLO target *and* got worse than before by
    more than `apply.maxRegressionPercent`: the coarse histogram buckets can place an unchanged p95
    above a tight target, and the change is to blame only for what changed. Unknown stays unknown.
    """
    slo = core.SloTargets.from_spec(spec.slo)
    tolerance = 1 + spec.apply.max_regression_percent / 100
    problems, unknown, fine = [], [], []
    for metric, target in slo.latency_targets().items():
        a, b = after.get(metric), before.get(metric)
        if not isinstance(a, (int, float)) or not math.isfinite(a):
            unknown.append(f"{metric} after the change is not measured")
            continue
        worse = isinstance(b, (int, float)) and b > 0 and a > b * tolerance
        if a > target and (worse or not isinstance(b, (int, float))):
            was = f", was {b:.4g} ms" if isinstance(b, (int, float)) else ""
            problems.append(f"p{slo.percentile} {metric} {a:.4g} ms > {target} ms target{was}")
        else:
            fine.append(f"p{slo.percentile} {metric} {a:.4g} ms")
    errors = after.get("errorRatePercent")
    if not isinstance(errors, (int, float)):
        unknown.append("error rate after the change is not measured")
    elif errors > slo.max_error_rate_percent:
        problems.append(f"error rate {errors:.3g}% > {slo.max_error_rate_percent:g}%")
    b, a = before.get("outputThroughput"), after.get("outputThroughput")
    if isinstance(b, (int, float)) and b > 0:
        if not isinstance(a, (int, float)):
            unknown.append("production throughput after the change is not measured")
        else:
            drop = 100.0 * (b - a) / b
            # Less served while requests queue is a regression; less served with an empty queue is
            # less traffic (a short window of a light stream is noisy), unless the queue is unknown.
            waiting = after.get("waitingRequests")
            queued = not isinstance(waiting, (int, float)) or waiting >= QUEUED_REQUESTS
            if drop > spec.apply.max_regression_percent and queued:
                problems.append(f"output throughput fell {drop:.0f}% ({b:.4g} -> {a:.4g} tok/s) with requests "
                                f"waiting, more than spec.apply.maxRegressionPercent "
                                f"{spec.apply.max_regression_percent}%")
    if problems:
        return "Violated", "; ".join(problems)
    if unknown:
        return "Unknown", "; ".join(unknown)
    return "Met", "; ".join(fine) or "no regression"


def report(spec: BatchTuningSpec, name: str, status: Mapping[str, Any], selection: TrialSelection) -> tuple[dict, dict]:
    import base64

    trials = selection.trials
    summary = {"bestTrial": selection.best["name"] if selection.best else None, "reason": selection.reason,
               "knee": selection.knee}
    png = report_mod.curves_png_isolated(trials, chosen=summary["bestTrial"],
                                knee_seqs=(selection.knee or {}).get("maxNumSeqs"),
                                slo=spec.slo.model_dump(by_alias=True), percentile=spec.slo.percentile.value,
                                title=f"BatchTuning {name}")
    data = {"trials.csv": report_mod.trials_csv(trials), "trials.json": report_mod.trials_json(trials, summary)}
    return data, {"curves.png": base64.b64encode(png).decode()}


def free_gpus(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> int:
    """GPUs the nodes offer less what pods hold or wait for (pending pods will take theirs)."""
    total = sum(int(((n.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0)) for n in nodes)
    used = 0
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in (pod.get("spec") or {}).get("containers") or []:
            used += gpus_per_trial(c)
    return max(0, total - used)
