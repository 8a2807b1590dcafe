"""Our strategies (`batchtune.core`: Adaptive, Bayesian) driven through their ask/tell interface, with
the core's planning, SLO evaluation (headroom included) and selection (knee), exactly as the
operator runs them; each asked setting becomes one operator-style trial on the testbed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from batchtune.bench.evaluate import TrialProtocol, TrialResult, TrialRunner
from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Choice, Knobs, Reading, Testbed

# (fits, reason) for one setting; fits None = unknown (kept), as the core's FitVerdict.
FitFn = Callable[[Scenario, Knobs], tuple[bool | None, str]]

_PERCENTILES = (50, 90, 95, 99)


def slo_targets(scenario: Scenario, headroom_pct: int):  # -> batchtune.core.slo.SloTargets
    """The scenario's SLO as the core's targets. One percentile per scenario (the CRD has one)."""
    from batchtune.core.slo import SloTargets

    fields: dict[str, int] = {}
    percentiles = set()
    names = {"ttft": "ttft_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
    for key, limit in scenario.slo.limits.items():
        pct, metric, _ = key.split("_")  # p95_ttft_ms
        percentiles.add(int(pct.removeprefix("p")))
        if metric not in names:
            raise ValueError(f"scenario {scenario.name}: SLO key {key!r} has no core target (ttft, itl, e2el)")
        fields[names[metric]] = int(limit)
    if len(percentiles) != 1 or next(iter(percentiles)) not in _PERCENTILES:
        raise ValueError(f"scenario {scenario.name}: SLO keys {list(scenario.slo.limits)} mix percentiles")
    return SloTargets(percentile=percentiles.pop(), headroom_percent=headroom_pct, **fields)


def status_metrics(reading: Reading | None, scenario: Scenario, percentile: int) -> dict[str, float]:
    """A reading in the status metric names the core reads (camelCase, latencies at the SLO percentile)."""
    if reading is None or not reading.ok:
        return {}
    m = reading.metrics
    p = f"p{percentile}"
    out = {
        "ttftMs": m.get(f"{p}_ttft_ms"),
        "itlMs": m.get(f"{p}_itl_ms"),
        "e2eMs": m.get(f"{p}_e2el_ms"),
        "outputThroughput": m.get("output_throughput"),
        "requestThroughput": m.get("request_throughput"),
        "kvCacheUsagePercent": m.get("kv_cache_usage_pct"),
        "preemptionsPerSecond": m.get("preemptions_per_s"),
        "gpuUtilPercent": m.get("gpu_util_pct"),
        "smActivePercent": m.get("sm_active_pct"),
        "powerWatts": m.get("power_w"),
    }
    running = m.get("max_concurrent_requests")
    if reading.load.kind == "concurrency" and running is not None:
        # A closed loop keeps its users' requests outstanding: those beyond the running batch wait.
        out["waitingRequests"] = max(0.0, reading.load.value - running)
    completed, failed = m.get("completed"), m.get("failed")
    if completed is not None and failed is not None and completed + failed > 0:
        out["errorRatePercent"] = 100.0 * failed / (completed + failed)
    else:
        out["errorRatePercent"] = 0.0
    return {k: float(v) for k, v in out.items() if v is not None}


def _reason(failure: str | None) -> str:
    from batchtune.core import outcomes

    text = failure or ""
    if "Free memory on device" in text:
        return outcomes.REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH
    if "No available memory for the cache blocks" in text or "KV cache is needed" in text:
        return outcomes.REASON_KV_CACHE_TOO_SMALL
    if "out of memory" in text.lower() or "OutOfMemory" in text:
        return outcomes.REASON_OUT_OF_MEMORY
    return "StartupFailed"


def to_outcome(result: TrialResult, scenario: Scenario, slo, objective):  # -> TrialOutcome
    from batchtune.core.outcomes import TrialOutcome, TrialState, Verdict
    from batchtune.core.objective import Objective

    if not result.started or result.failure is not None:
        return TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=_reason(result.failure),
                            message=(result.failure or "")[:200])
    metrics = status_metrics(result.reading, scenario, slo.percentile)
    # The operator's trial metrics carry the peaks over every load step (`controller.tuning.trial_outcome`).
    if result.kv_usage_peak_pct is not None:
        metrics["kvCacheUsagePeakPercent"] = result.kv_usage_peak_pct
    if result.preemptions_peak_per_s is not None:
        metrics["preemptionsPeakPerSecond"] = result.preemptions_peak_per_s
    if objective is Objective.SLO_CAPACITY:
        metrics["sloCapacity"] = result.objective
    if not result.met:
        return TrialOutcome(TrialState.DONE, Verdict.VIOLATED, None, metrics, reason="SloViolated")
    return TrialOutcome(TrialState.DONE, Verdict.MET, result.objective, metrics, reason="SloMet")


@dataclass(frozen=True)
class CoreStrategy:
    kind: str
    """`Adaptive` or `Bayesian` (any `make_strategy` kind)."""
    max_trials: int = 12
    """The BatchTuning default `maxTrials`."""
    headroom_pct: int = 10
    """The BatchTuning default `slo.headroomPercent`."""
    fits: FitFn | None = None
    """The memory-fit prefilter the operator plans with (the twin's estimator); None: none."""
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.kind.lower()

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        from batchtune.core.objective import Objective
        from batchtune.core.planning import EngineLimits, FitVerdict, SearchSpace, plan_candidates
        from batchtune.core.selection import CompletedTrial, select_best
        from batchtune.core.settings import Setting
        from batchtune.core.strategies import make_strategy

        objective = Objective.SLO_CAPACITY if scenario.objective == "capacity" else Objective.OUTPUT_THROUGHPUT
        slo = slo_targets(scenario, self.headroom_pct)
        space = scenario.tuner_space
        mbts = tuple(m for m in space.max_num_batched_tokens if m is not None)
        core_space = SearchSpace(space.max_num_seqs, space.gpu_memory_utilization_pct, mbts)
        fit = None
        if self.fits is not None:
            fits = self.fits

            def fit(setting: Setting) -> FitVerdict:
                ok, reason = fits(scenario, _knobs(setting))
                return FitVerdict(ok, reason)

        limits = EngineLimits(max_model_len=scenario.max_model_len)
        plan = plan_candidates(core_space, limits, fit)
        if not plan.candidates:
            return Choice(None, None, plan.error or "empty plan")
        # As the controller (`tuning._core_plan`): what the memory prefilter pruned stays in the plan and
        # enters the history as Infeasible, outside the trial budget.
        learned = learned_from_prefilter(plan)
        if learned:
            plan = plan_candidates(core_space, limits)
        strategy = make_strategy(self.kind, plan, slo, objective, seed=seed,
                                 max_trials=self.max_trials + len(learned))
        runner = TrialRunner(testbed, scenario, TrialProtocol(headroom_pct=self.headroom_pct))
        history: list = list(learned)
        completed: list[CompletedTrial] = []
        claimed: dict[Setting, TrialResult] = {}
        while (setting := strategy.ask(history)) is not None:
            result = runner.run(_knobs(setting))
            outcome = to_outcome(result, scenario, slo, objective)
            strategy.tell(setting, outcome)
            history.append((setting, outcome))
            completed.append(CompletedTrial(f"trial-{len(completed)}", setting, outcome))
            claimed[setting] = result
        selection = select_best(completed, objective, slo)
        if selection.best is None:
            return Choice(None, None, selection.reason)
        chosen = claimed[selection.best]
        return Choice(_knobs(selection.best), chosen.claimed_load, selection.reason)


def learned_from_prefilter(plan) -> list:  # -> list[HistoryEntry]
    """The prefilter's memory prunes as Infeasible history entries, with vLLM's memory reason
    (`controller.tuning._core_plan`)."""
    from batchtune.core import outcomes
    from batchtune.core.outcomes import TrialOutcome, TrialState, Verdict

    prefix = "does not fit in GPU memory"
    out = []
    for pruned in plan.pruned:
        if not pruned.reason.startswith(prefix):
            continue
        reason = (outcomes.REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH if "Free memory on device" in pruned.reason
                  else outcomes.REASON_KV_CACHE_TOO_SMALL)
        out.append((pruned.setting, TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=reason,
                                                 message=pruned.reason[:200])))
    return out


def _knobs(setting) -> Knobs:
    return Knobs(setting.max_num_seqs, setting.gpu_memory_utilization_percent, setting.max_num_batched_tokens)
