"""The level-based reconcile: look at spec, status, trial objects and Prometheus; take the next step.

Every step is safe to repeat: objects have deterministic names and are created only if missing,
and an intent is written to status before the object it describes is created.
"""

from __future__ import annotations

import json
import logging
import os
from copy import deepcopy
from datetime import datetime, timedelta
from typing import Any

import kopf

from batchtune.api import InvalidBatchTuning, parse_spec
from batchtune.api.models import BatchTuningSpec, ObjectiveType
from batchtune.controller import kube, metrics, tuning
from batchtune.controller.conditions import get_condition, now_iso, set_condition
from batchtune.controller.failures import classify_pod, pod_is_ready
from batchtune.controller.gitops import gitops_manager
from batchtune.controller.loadsearch import LoadStep, SearchBounds, capacity, next_load
from batchtune.controller.prom import Prometheus, PrometheusUnavailable

TERMINAL_PHASES = {"Succeeded", "Recommended", "RolledBack", "Failed"}
ACTIVE_TRIAL_STATES = {"Pending", "Deploying", "Warming", "Measuring"}
FINISHED_TRIAL_STATES = {"Done", "Infeasible", "Failed"}

# Prometheus needs a couple of scrapes after a load run ends before the window is complete.
SCRAPE_LAG_SECONDS = float(os.environ.get("BATCHTUNE_SCRAPE_LAG_SECONDS", "6"))
# The image of the builtin load generator (the operator's own image).
OPERATOR_IMAGE = os.environ.get("BATCHTUNE_IMAGE", "ghcr.io/batchtune/batchtune:0.1.0")
# A load step whose data never shows up is run again this many times, then the trial is marked unknown.
MAX_MEASURE_ATTEMPTS = 3
# Steps of the per-trial SLO-capacity search (each is one load run).
MAX_LOAD_STEPS = 5

ANN_PREVIOUS = "batchtune.io/previous-args"
ANN_APPLIED_AT = "batchtune.io/applied-at"
ANN_APPLIED_BY = "batchtune.io/applied-by"


# Back-off after Prometheus failures, per BatchTuning (uid -> (failures, not before)). Kept in memory:
# it only spaces out retries, so losing it on a restart costs one early retry.
_PROMETHEUS_BACKOFF: dict[str, tuple[int, datetime]] = {}
MAX_BACKOFF_SECONDS = 60


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value if v is not None]
    return value


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


class Reconcile:
    def __init__(self, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, now: datetime) -> None:
        self.body = body
        self.patch = patch
        self.log = logger
        self.now = now
        self.meta = body["metadata"]
        self.ns = self.meta["namespace"]
        self.name = self.meta["name"]
        self.uid = self.meta["uid"]
        self.generation = self.meta.get("generation")
        self.status: dict[str, Any] = deepcopy(dict(body.get("status") or {}))
        self.changed: set[str] = set()
        self.spec: BatchTuningSpec | None = None
        self._prom: Prometheus | None = None

    # ---- status bookkeeping -------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        if self.status.get(key) != value:
            self.status[key] = value
            self.changed.add(key)

    def condition(self, type_: str, status: bool, reason: str, message: str) -> bool:
        """Sets a condition; True when its status or reason changed (the moment to emit an Event)."""
        old = get_condition(self.status.get("conditions") or [], type_)
        new = set_condition(self.status.get("conditions") or [], type_, status, reason, message,
                            self.generation, self.now)
        self.set("conditions", new)
        return old is None or old.get("status") != ("True" if status else "False") or old.get("reason") != reason

    def event(self, type_: str, reason: str, message: str) -> None:
        kopf.event(self.body, type=type_, reason=reason, message=message[:1000])

    def phase(self, phase: str, reason: str, message: str) -> None:
        self.set("phase", phase)
        progressing = phase not in TERMINAL_PHASES
        self.condition("Progressing", progressing, reason, message)
        if phase in ("Succeeded", "Recommended"):
            self.condition("Succeeded", True, reason, message)
            self.condition("Failed", False, reason, message)
        elif phase in ("Failed", "RolledBack"):
            self.condition("Succeeded", False, reason, message)
            self.condition("Failed", True, reason, message)

    def fail(self, reason: str, message: str) -> None:
        if self.status.get("phase") != "Failed" or \
                (get_condition(self.status.get("conditions") or [], "Failed") or {}).get("reason") != reason:
            self.event("Warning", reason, message)
            self.log.warning("Tuning %s failed: %s", self.name, message)
        self.phase("Failed", reason, message)

    def flush(self) -> None:
        # The CRD has no nullable fields: nested nulls are dropped, a top-level null deletes the key.
        for key in self.changed:
            value = self.status[key]
            self.patch.status[key] = _drop_nulls(value) if isinstance(value, (dict, list)) else value

    # ---- entry --------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.flush()

    def _run(self) -> None:
        backoff = _PROMETHEUS_BACKOFF.get(self.uid)
        if backoff and self.now < backoff[1]:
            return  # Prometheus failed recently; the next try waits out the back-off
        observed = self.status.get("observedGeneration")
        if observed is not None and observed != self.generation:
            self.restart()
            return
        try:
            self.spec = parse_spec(dict(self.body.get("spec") or {}))
        except InvalidBatchTuning as exc:
            self.set("observedGeneration", self.generation)
            self.fail("InvalidSpec", str(exc))
            return
        if observed is None:
            self.set("observedGeneration", self.generation)
            self.set("phase", "Pending")
        phase = self.status.get("phase") or "Pending"
        step = {
            "Pending": self.plan, "Planning": self.plan, "Trialing": self.trials, "Selecting": self.select,
            "Applying": self.apply, "Verifying": self.verify,
        }.get(phase)
        if step is not None:
            step()

    def restart(self) -> None:
        """A new generation of the spec: stop what runs, restore production if unverified, plan again."""
        self.rollback_if_unverified("SpecChanged")
        removed = kube.delete_owned(self.ns, self.name)
        self.log.info("Restarted tuning %s for generation %s (removed %d objects)", self.name, self.generation, removed)
        for key, value in (("trials", []), ("pruned", []), ("trialsPlanned", 0), ("trialsCompleted", 0),
                           ("bestTrial", None), ("bestSetting", None), ("knee", None), ("recommendation", None),
                           ("plan", None), ("workload", None), ("observedGeneration", self.generation)):
            self.set(key, value)
        self.phase("Pending", "SpecChanged", f"Spec generation {self.generation}: planning again")
        self.event("Normal", "SpecChanged", f"Spec changed (generation {self.generation}); planning again")

    def served_model(self) -> str | None:
        return (self.status.get("plan") or {}).get("servedModel")

    # ---- Prometheus ---------------------------------------------------------------------

    def prom(self) -> Prometheus:
        if self._prom is None:
            assert self.spec is not None
            token = None
            ref = self.spec.prometheus.auth_secret_ref
            if ref is not None:
                token = kube.read_secret_key(self.ns, ref.name, ref.key)
            self._prom = Prometheus(self.spec.prometheus.url, token,
                                    on_error=metrics.PROMETHEUS_ERRORS.inc)
        return self._prom

    def prometheus_down(self, exc: Exception) -> None:
        failures = _PROMETHEUS_BACKOFF.get(self.uid, (0, self.now))[0] + 1
        delay = min(MAX_BACKOFF_SECONDS, 2 ** failures)
        _PROMETHEUS_BACKOFF[self.uid] = (failures, self.now + timedelta(seconds=delay))
        if self.condition("Degraded", True, "PrometheusUnreachable",
                          f"Prometheus at {self.spec.prometheus.url} (spec.prometheus.url) did not answer: {exc}; "
                          f"no decision is taken on missing data, retrying in {delay}s"):
            self.event("Warning", "PrometheusUnreachable", str(exc))

    def prometheus_ok(self) -> None:
        _PROMETHEUS_BACKOFF.pop(self.uid, None)
        cond = get_condition(self.status.get("conditions") or [], "Degraded")
        if cond and cond.get("status") == "True" and cond.get("reason") == "PrometheusUnreachable":
            self.condition("Degraded", False, "PrometheusReachable", "Prometheus answers again")

    # ---- Planning -----------------------------------------------------------------------

    def target(self) -> tuple[dict, dict] | None:
        """The target Deployment and its vLLM container, or None after setting a condition."""
        assert self.spec is not None
        ref = self.spec.target_ref
        target = kube.get_deployment(self.ns, ref.name)
        if target is None:
            message = f"Deployment {self.ns}/{ref.name} (spec.targetRef.name) not found; waiting for it"
            if self.condition("Progressing", False, "TargetNotFound", message):
                self.event("Warning", "TargetNotFound", message)
            return None
        try:
            container = tuning.find_vllm_container(target, ref.container_name)
        except tuning.UnsafeShell as exc:
            self.fail("UnsupportedArgs", f"Deployment {self.ns}/{ref.name}: {exc}")
            return None
        except tuning.ArgsError as exc:
            self.fail("NoVllmContainer", f"Deployment {self.ns}/{ref.name}: {exc}")
            return None
        return target, container

    def plan(self) -> None:
        assert self.spec is not None
        found = self.target()
        if found is None:
            return
        target, container = found
        try:
            baseline = tuning.read_baseline(container)
        except tuning.ArgsError as exc:
            self.fail("UnsupportedArgs", f"Deployment {self.ns}/{self.spec.target_ref.name}: {exc}")
            return
        try:
            self.prom().scalar("vector(1)")
        except PrometheusUnavailable as exc:
            self.prometheus_down(exc)
            self.set("phase", "Planning")
            return
        self.prometheus_ok()
        gpu_product = self.gpu_product(target)
        workload = self.production_workload(target) if self.spec.load.from_production else None
        plan = tuning.make_plan(self.spec, baseline, gpu_product)
        if not plan.candidates:
            self.set("pruned", tuning.pruned_status(plan))
            self.fail("EmptySearchSpace", "No setting is left to try after constraints: " + plan.summary())
            return
        planned = min(self.spec.strategy.max_trials, len(plan.candidates))
        self.set("baseline", tuning.baseline_status(baseline))
        self.set("pruned", tuning.pruned_status(plan))
        self.set("plan", {"gpuProduct": gpu_product, "model": baseline.model,
                          "servedModel": baseline.served_model_name or baseline.model,
                          "engineLimits": tuning.engine_limits_status(baseline),
                          "candidates": len(plan.candidates),
                          "notes": list(plan.notes[:20]), "startedAt": now_iso(self.now)})
        if workload:
            self.set("workload", workload)
        self.set("trialsPlanned", planned)
        self.set("trialsCompleted", 0)
        self.set("trials", self.status.get("trials") or [])
        self.phase("Trialing", "Planned", f"{planned} trials planned from {len(plan.candidates)} candidates "
                                          f"({len(plan.pruned)} pruned)")
        self.event("Normal", "Planned", f"{planned} trials planned; " + plan.summary())

    def gpu_product(self, target: dict) -> str | None:
        selector = ((target["spec"]["template"].get("spec") or {}).get("nodeSelector") or {})
        if kube.GPU_PRODUCT_LABEL in selector:
            return selector[kube.GPU_PRODUCT_LABEL]
        labels = target["spec"]["selector"].get("matchLabels") or {}
        pods = kube.list_pods(self.ns, ",".join(f"{k}={v}" for k, v in labels.items())) if labels else []
        node_names = {p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName")}
        for node in kube.nodes() or []:
            if node["metadata"]["name"] in node_names:
                product = (node["metadata"].get("labels") or {}).get(kube.GPU_PRODUCT_LABEL)
                if product:
                    return product
        return None

    def production_pods(self, target: dict) -> list[str]:
        labels = target["spec"]["selector"].get("matchLabels") or {}
        pods = kube.list_pods(self.ns, ",".join(f"{k}={v}" for k, v in labels.items())) if labels else []
        return sorted(p["metadata"]["name"] for p in pods if kube.TUNING_LABEL not in p["metadata"].get("labels", {}))

    def production_workload(self, target: dict) -> dict[str, int] | None:
        pods = self.production_pods(target)
        try:
            return tuning.production_workload(self.prom(), self.spec, self.ns, pods)
        except PrometheusUnavailable as exc:
            self.prometheus_down(exc)
            return None

    # ---- Trialing -----------------------------------------------------------------------

    def trials(self) -> None:
        assert self.spec is not None
        found = self.target()
        if found is None:
            return
        target, container = found
        trials: list[dict] = deepcopy(self.status.get("trials") or [])
        deployments, jobs = kube.list_owned(self.ns, self.name)
        dep_names = {d["metadata"]["name"] for d in deployments}
        job_by_name = {j["metadata"]["name"]: j for j in jobs}
        for trial in trials:
            if trial["state"] in ACTIVE_TRIAL_STATES:
                self.advance(trial, target, container, dep_names, job_by_name)
        self.launch(trials, target, container)
        finished = [t for t in trials if t["state"] in FINISHED_TRIAL_STATES]
        self.set("trials", trials)
        self.set("trialsCompleted", len(finished))
        active = [t for t in trials if t["state"] in ACTIVE_TRIAL_STATES]
        if not active and (len(trials) >= self.status.get("trialsPlanned", 0) or self._strategy_done):
            self.phase("Selecting", "TrialsDone", f"{len(finished)} trials finished")

    _strategy_done = False

    def launch(self, trials: list[dict], target: dict, container: dict) -> None:
        active = [t for t in trials if t["state"] in ACTIVE_TRIAL_STATES]
        budget = self.status.get("trialsPlanned", 0) - len(trials)
        slots = self.spec.strategy.max_parallel_trials - len(active)
        if budget <= 0 or slots <= 0:
            return
        gpus_free = self.free_gpus(target, container)
        per_trial = tuning.gpus_per_trial(container)
        if gpus_free is not None and per_trial:
            slots = min(slots, gpus_free // per_trial)
            if slots <= 0:
                self.condition("Progressing", True, "WaitingForGPUs",
                               f"No free nvidia.com/gpu for the next trial (needs {per_trial}); waiting")
                return
        baseline = self.status.get("baseline") or {}
        for _ in range(min(slots, budget)):
            setting = tuning.next_setting(self.spec, self.status.get("plan") or {}, baseline, trials,
                                          self.status.get("pruned") or [])
            if setting is None:
                self._strategy_done = True
                return
            index = len(trials)
            trial = {"index": index, "name": tuning.trial_name(self.name, index), "setting": setting,
                     "state": "Deploying", "startedAt": now_iso(self.now), "steps": []}
            trials.append(trial)
            # The Deployment is created on the next tick, after this intent is in status.
            self.event("Normal", "TrialStarted", f"Trial {trial['name']}: {tuning.setting_label(setting)}")
            self.log.info("Started trial %s: %s", trial["name"], tuning.setting_label(setting))

    def free_gpus(self, target: dict, container: dict) -> int | None:
        nodes = kube.nodes()
        if nodes is None:
            return None
        selector = (target["spec"]["template"].get("spec") or {}).get("nodeSelector") or {}
        eligible = {n["metadata"]["name"]: n for n in nodes
                    if all((n["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
                    and kube.GPU_RESOURCE in ((n.get("status") or {}).get("allocatable") or {})}
        pods = kube.gpu_pods_on_nodes(set(eligible))
        if pods is None:
            return None
        return tuning.free_gpus(eligible.values(), pods)

    def advance(self, trial: dict, target: dict, container: dict, dep_names: set[str],
                jobs: dict[str, dict]) -> None:
        if trial["state"] in ("Pending", "Deploying"):
            self.deploying(trial, target, container, dep_names)
        elif trial["state"] in ("Warming", "Measuring"):
            self.measuring(trial, container, jobs)

    def trial_pod(self, trial: dict) -> dict | None:
        pods = kube.list_pods(self.ns, tuning.trial_pod_selector(self.name, trial["index"]))
        # A pod the node rejected (phase Failed) is replaced by its ReplicaSet; never judge by it.
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")
                and (p.get("status") or {}).get("phase") not in ("Failed", "Succeeded")]
        return max(pods, key=lambda p: p["metadata"]["creationTimestamp"]) if pods else None

    def deploying(self, trial: dict, target: dict, container: dict, dep_names: set[str]) -> None:
        if trial["name"] not in dep_names:
            manifest = tuning.trial_deployment(self.spec, target, container, self.name, self.uid, self.ns, trial)
            if kube.create_if_missing(manifest):
                self.log.info("Created trial Deployment %s", trial["name"])
            return
        pod = self.trial_pod(trial)
        if pod is not None and pod_is_ready(pod):
            trial["podIP"] = pod["status"].get("podIP")
            trial["port"] = tuning.serving_port(container)
            trial["readyAt"] = now_iso(self.now)
            trial["state"] = "Measuring"
            self.log.info("Trial %s is ready at %s", trial["name"], trial["podIP"])
            return
        failure = classify_pod(pod, container["name"], self.now, self.spec.trial.readiness_timeout_seconds,
                               created_at=trial.get("startedAt")) if pod else None
        if pod is None and _parse_time(trial["startedAt"]) + timedelta(
                seconds=self.spec.trial.readiness_timeout_seconds) < self.now:
            failure = tuning.readiness_timeout(self.spec)
        if failure is not None:
            self.finish(trial, "Infeasible", failure.reason.value, failure.message, verdict="Violated")
            self.event("Warning", "TrialInfeasible", f"Trial {trial['name']} ({tuning.setting_label(trial['setting'])}):"
                                                     f" {failure.reason.value}: {failure.message}")
            return

    def measuring(self, trial: dict, container: dict, jobs: dict[str, dict]) -> None:
        pod = self.trial_pod(trial)
        if pod is None or not pod_is_ready(pod):
            failure = classify_pod(pod, container["name"], self.now, 0) if pod else None
            reason = failure.reason.value if failure else "TrialPodLost"
            message = failure.message if failure else "the trial pod stopped being ready under load"
            self.finish(trial, "Infeasible", reason, message, verdict="Violated")
            self.event("Warning", "TrialInfeasible", f"Trial {trial['name']}: {reason}: {message}")
            return
        steps: list[dict] = trial.setdefault("steps", [])
        current = next((s for s in steps if s.get("verdict") is None), None)
        if current is None:
            load = self.next_load(trial)
            if load is None:
                self.conclude(trial)
                return
            current = {"load": load, "repeat": 0, "attempt": 0, "results": []}
            steps.append(current)
        job_name = tuning.job_name(trial["name"], len(steps) - 1, current["repeat"], current["attempt"])
        job = jobs.get(job_name)
        if job is None:
            if not current.get("job") == job_name:
                current["job"] = job_name
                return  # intent first; the Job is created on the next tick
            manifest = tuning.load_job(self.spec, self.status, self.name, self.uid, self.ns, trial, current, job_name,
                                       OPERATOR_IMAGE, container.get("image", ""), self.served_model())
            kube.create_if_missing(manifest)
            trial["state"] = "Warming"
            return
        done, failed, started, finished = tuning.job_state(job)
        if not done:
            if started and _parse_time(started) + timedelta(seconds=self.spec.trial.warmup_seconds) < self.now:
                trial["state"] = "Measuring"
            return
        if failed:
            current["attempt"] += 1
            kube.delete_job(self.ns, job_name)
            if current["attempt"] >= MAX_MEASURE_ATTEMPTS:
                self.finish(trial, "Failed", "LoadGeneratorFailed",
                            f"the load generator failed {MAX_MEASURE_ATTEMPTS} times: {tuning.job_message(self.ns, job)}",
                            verdict="Unknown")
            return
        if _parse_time(finished) + timedelta(seconds=SCRAPE_LAG_SECONDS) > self.now:
            return
        window_start = _parse_time(started) + timedelta(seconds=self.spec.trial.warmup_seconds)
        try:
            result = tuning.measure_trial(self.prom(), self.spec, self.ns, pod["metadata"]["name"],
                                          self.served_model(), window_start, _parse_time(finished))
        except PrometheusUnavailable as exc:
            # Keep the Job: its window stays in Prometheus' storage for when it comes back.
            self.prometheus_down(exc)
            return
        self.prometheus_ok()
        summary = tuning.loadgen_summary(self.ns, job)
        if not result.complete:
            current["attempt"] += 1
            kube.delete_job(self.ns, job_name)
            self.log.warning("Trial %s: measurement incomplete (%s); attempt %d", trial["name"],
                             ", ".join(result.missing), current["attempt"])
            if current["attempt"] >= MAX_MEASURE_ATTEMPTS:
                self.finish(trial, "Failed", "MeasurementUnavailable",
                            "no complete data in Prometheus for " + ", ".join(result.missing), verdict="Unknown")
            return
        current["results"].append(tuning.step_result(result, summary, int(self.spec.slo.percentile.value[1:])))
        kube.delete_job(self.ns, job_name)
        if len(current["results"]) < self.spec.trial.repeats:
            current["repeat"] += 1
            current["attempt"] = 0
            return
        tuning.close_step(self.spec, current)
        if self.next_load(trial) is None:
            self.conclude(trial)  # the verdict in this tick, not the next

    def next_load(self, trial: dict) -> int | None:
        steps = trial.get("steps") or []
        if self.spec.objective.type != ObjectiveType.SLO_CAPACITY:
            return None if steps else tuning.fixed_load(self.spec, trial, self.status.get("workload"))
        bounds = SearchBounds(start=tuning.capacity_start(self.spec, trial, self.status.get("trials") or []),
                              highest=tuning.capacity_ceiling(self.spec, trial), max_steps=MAX_LOAD_STEPS)
        return next_load([tuning.as_load_step(s) for s in steps], bounds)

    def conclude(self, trial: dict) -> None:
        steps = trial.get("steps") or []
        outcome = tuning.trial_outcome(self.spec, steps)
        trial["metrics"] = outcome.metrics
        for step in steps:
            step.pop("results", None)  # keep status small: the step's summary stays, per-repeat data goes
        self.finish(trial, "Done", outcome.reason_code, outcome.message, verdict=outcome.verdict,
                    verdict_reason=outcome.verdict_reason)
        self.event("Normal", "TrialCompleted", f"Trial {trial['name']} ({tuning.setting_label(trial['setting'])}): "
                                               f"{outcome.verdict}: {outcome.verdict_reason}")

    def finish(self, trial: dict, state: str, reason: str, message: str, verdict: str,
               verdict_reason: str | None = None) -> None:
        trial.update({"state": state, "reason": reason, "message": message[:1000], "verdict": verdict,
                      "verdictReason": (verdict_reason or message)[:1000], "finishedAt": now_iso(self.now)})
        kube.delete_deployment(self.ns, trial["name"])
        for step in trial.get("steps") or []:
            if step.get("job"):
                kube.delete_job(self.ns, step["job"])
        metrics.TRIALS.labels(result=state).inc()
        self.log.info("Finished trial %s: %s (%s)", trial["name"], state, reason)

    # ---- Selecting ----------------------------------------------------------------------

    def select(self) -> None:
        assert self.spec is not None
        found = self.target()
        if found is None:
            return
        target, container = found
        trials = self.status.get("trials") or []
        selection = tuning.select(self.spec, trials)
        self.set("trials", selection.trials)
        if selection.knee is not None:
            self.set("knee", selection.knee)
        started = _parse_time((self.status.get("plan") or {}).get("startedAt"))
        if started:
            metrics.TUNING_DURATION.observe((self.now - started).total_seconds())
        if selection.best is None:
            self.write_report(target, selection)
            self.fail("NoFeasibleSetting", selection.reason)
            return
        replicas = None
        try:
            replicas = tuning.replicas_hint(self.prom(), self.spec, self.ns, self.production_pods(target),
                                            selection.best)
        except PrometheusUnavailable as exc:
            self.prometheus_down(exc)
            return
        recommendation = tuning.recommendation(self.spec, target, container, selection, replicas)
        self.set("bestTrial", selection.best["name"])
        self.set("bestSetting", tuning.setting_label(selection.best["setting"]))
        self.set("recommendation", recommendation)
        self.write_report(target, selection)
        manager = gitops_manager(target)
        mode = self.spec.apply.mode.value if self.spec.apply.mode else ("Recommend" if manager else "Auto")
        if mode == "Recommend":
            why = (f"the target is managed by {manager}; set spec.apply.mode: Auto to patch it anyway"
                   if manager and not self.spec.apply.mode else "spec.apply.mode is Recommend")
            message = f"Recommended {self.status['bestSetting']} ({why}): {selection.reason}"
            self.phase("Recommended", "RecommendationReady", message)
            self.event("Normal", "RecommendationReady", message)
            return
        self.phase("Applying", "Selected", f"Selected {self.status['bestSetting']}: {selection.reason}")

    def write_report(self, target: dict, selection: Any) -> None:
        try:
            data, binary = tuning.report(self.spec, self.name, self.status, selection)
            kube.upsert_configmap(self.ns, f"{self.name}-report", data, binary, tuning.owner_reference(self.name, self.uid),
                                  {kube.TUNING_LABEL: self.name})
        except Exception as exc:  # a report is nice to have; the decision must not wait on it
            self.log.warning("Report for %s not written: %s", self.name, exc)

    # ---- Applying and verifying ---------------------------------------------------------

    def apply(self) -> None:
        assert self.spec is not None
        found = self.target()
        if found is None:
            return
        target, container = found
        rec = self.status.get("recommendation") or {}
        current = {"command": container.get("command"), "args": container.get("args")}
        desired = rec.get("container") or {}
        applied = self.status.get("applied") or {}
        if not applied.get("appliedAt"):
            if current == desired:
                self.phase("Succeeded", "AlreadyOptimal", "Production already runs the chosen setting")
                return
            annotations = (target["metadata"].get("annotations") or {})
            last = _parse_time(annotations.get(ANN_APPLIED_AT))
            if last and last + timedelta(seconds=self.spec.apply.cooldown_seconds) > self.now:
                wait_until = last + timedelta(seconds=self.spec.apply.cooldown_seconds)
                self.condition("Progressing", True, "CooldownActive",
                               f"Production was changed at {annotations.get(ANN_APPLIED_AT)}; "
                               f"spec.apply.cooldownSeconds holds the next change until {now_iso(wait_until)}")
                return
            if applied.get("previous") is None:
                try:
                    before = tuning.production_metrics(self.prom(), self.spec, self.ns, self.production_pods(target),
                                                       self.now - timedelta(seconds=max(60, self.spec.apply.verify_seconds)),
                                                       self.now)
                except PrometheusUnavailable as exc:
                    self.prometheus_down(exc)
                    return
                # Checkpoint the exact previous args before touching production.
                self.set("applied", {"previous": current, "new": desired, "before": before,
                                     "previousArgs": tuning.flat_args(current), "newArgs": tuning.flat_args(desired)})
                return
            kube.patch_container_args(self.ns, target["metadata"]["name"], container["name"], desired.get("command"),
                                      desired.get("args"), {
                                          ANN_PREVIOUS: json.dumps(applied["previous"], sort_keys=True),
                                          ANN_APPLIED_AT: now_iso(self.now), ANN_APPLIED_BY: self.name})
            applied = dict(applied, appliedAt=now_iso(self.now))
            self.set("applied", applied)
            self.event("Normal", "RecommendationApplied",
                       f"Patched {self.ns}/{target['metadata']['name']} to {self.status.get('bestSetting')}")
            self.log.info("Applied %s to %s", self.status.get("bestSetting"), target["metadata"]["name"])
        self.phase("Verifying", "Applied", f"Verifying {self.status.get('bestSetting')} on production for "
                                           f"{self.spec.apply.verify_seconds}s")

    def verify(self) -> None:
        assert self.spec is not None
        found = self.target()
        if found is None:
            return
        target, _ = found
        applied = dict(self.status.get("applied") or {})
        if not tuning.rollout_complete(target):
            deadline = _parse_time(applied["appliedAt"]) + timedelta(
                seconds=self.spec.trial.readiness_timeout_seconds)
            if self.now > deadline:
                self.rollback("RolloutStuck", "the rollout did not complete within "
                              f"{self.spec.trial.readiness_timeout_seconds}s (spec.trial.readinessTimeoutSeconds)")
            return
        if not applied.get("rolloutCompletedAt"):
            applied["rolloutCompletedAt"] = now_iso(self.now)
            self.set("applied", applied)
            return
        start = _parse_time(applied["rolloutCompletedAt"])
        end = start + timedelta(seconds=self.spec.apply.verify_seconds)
        if self.now < end + timedelta(seconds=SCRAPE_LAG_SECONDS):
            return
        try:
            after = tuning.production_metrics(self.prom(), self.spec, self.ns, self.production_pods(target),
                                              start, end)
        except PrometheusUnavailable as exc:
            self.prometheus_down(exc)
            if self.now > end + timedelta(seconds=3 * max(60, self.spec.apply.verify_seconds)):
                self.rollback("VerifyInconclusive", f"no production metrics to verify with: {exc}")
            return
        verdict, reason = tuning.verify_verdict(self.spec, applied.get("before") or {}, after)
        if verdict == "Unknown":
            if self.now > end + timedelta(seconds=3 * max(60, self.spec.apply.verify_seconds)):
                self.rollback("VerifyInconclusive", reason)
            return
        if verdict == "Violated":
            self.rollback("Regression", reason)
            return
        applied["verifiedAt"] = now_iso(self.now)
        applied["after"] = after
        self.set("applied", applied)
        message = f"{self.status.get('bestSetting')} verified on production: {reason}"
        self.phase("Succeeded", "Verified", message)
        self.event("Normal", "Verified", message)

    def rollback(self, reason: str, message: str) -> None:
        restore_production(self.ns, self.spec.target_ref.name if self.spec else None, self.status, self.log)
        applied = dict(self.status.get("applied") or {})
        applied["rolledBackAt"] = now_iso(self.now)
        self.set("applied", applied)
        metrics.ROLLBACKS.inc()
        text = f"Rolled production back to its previous args: {reason}: {message}"
        self.log.warning("Rolled back %s: %s: %s", self.spec.target_ref.name if self.spec else "?", reason, message)
        self.phase("RolledBack", reason, text)
        self.condition("Degraded", True, reason, text)
        self.event("Warning", "RolledBack", text)

    def rollback_if_unverified(self, reason: str) -> None:
        applied = self.status.get("applied") or {}
        if self.status.get("phase") in ("Applying", "Verifying") and applied.get("appliedAt") \
                and not applied.get("verifiedAt") and not applied.get("rolledBackAt"):
            name = ((self.body.get("spec") or {}).get("targetRef") or {}).get("name")
            restore_production(self.ns, name, self.status, self.log)
            self.set("applied", dict(applied, rolledBackAt=now_iso(self.now)))
            self.event("Warning", "RolledBack", f"Restored production's previous args ({reason})")


def restore_production(namespace: str, target_name: str | None, status: dict, log: logging.Logger) -> bool:
    """Puts the target container's previous command/args back exactly; True when a patch was sent."""
    applied = status.get("applied") or {}
    previous = applied.get("previous")
    container = ((status.get("recommendation") or {}).get("containerName"))
    if not target_name or previous is None or not container:
        return False
    if kube.get_deployment(namespace, target_name) is None:
        return False
    kube.patch_container_args(namespace, target_name, container, previous.get("command"), previous.get("args"),
                              {ANN_PREVIOUS: None, ANN_APPLIED_BY: None})
    log.info("Restored %s/%s to its previous args", namespace, target_name)
    return True


def on_delete(body: kopf.Body, log: logging.Logger) -> None:
    meta = body["metadata"]
    status = dict(body.get("status") or {})
    applied = status.get("applied") or {}
    if status.get("phase") in ("Applying", "Verifying") and applied.get("appliedAt") and not applied.get("verifiedAt"):
        target = ((body.get("spec") or {}).get("targetRef") or {}).get("name")
        if restore_production(meta["namespace"], target, status, log):
            kopf.event(body, type="Warning", reason="RolledBack",
                       message="BatchTuning deleted during verify; restored production's previous args")
    removed = kube.delete_owned(meta["namespace"], meta["name"])
    log.info("Cleaned up tuning %s (%d objects)", meta["name"], removed)
