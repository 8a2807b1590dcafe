"""Our strategies (`batchtune.core`: Adaptive, Bayesian) driven through their ask/tell interface, with
the core's planning, SLO evaluation (headroom included) and selection (knee), exactly as the
operator runs them; each asked setting becomes one operator-style trial on the testbed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchtune.bench.evaluate import TrialProtocol, TrialResult, TrialRunner
from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Choice, Knobs, Reading, Testbed
from batchtune.core.objective import Objective
from batchtune.core.outcomes import HistoryEntry, TrialOutcome
from batchtune.core.planning import EngineLimits, FitVerdict, SearchSpace, plan_candidates
from batchtune.core.search import Search
from batchtune.core.selection import CompletedTrial, select_best
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets
from batchtune.core.vocabulary import M, Reason, TrialState, Verdict
from batchtune.engines import VLLM

# (fits, reason) for one setting; fits None = unknown (kept), as the core's FitVerdict.
FitFn = Callable[[Scenario, Knobs], tuple[bool | None, str]]

_PERCENTILES = (50, 90, 95, 99)


def slo_targets(scenario: Scenario, headroom_pct: int) -> SloTargets:
    """The scenario's SLO as the core's targets. One percentile per scenario (the CRD has one)."""
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
    out: dict[str, float | None] = {
        M.TTFT_MS: m.get(f"{p}_ttft_ms"),
        M.ITL_MS: m.get(f"{p}_itl_ms"),
        M.E2E_MS: m.get(f"{p}_e2el_ms"),
        M.OUTPUT_THROUGHPUT: m.get("output_throughput"),
        M.REQUEST_THROUGHPUT: m.get("request_throughput"),
        M.KV_CACHE_USAGE_PERCENT: m.get("kv_cache_usage_pct"),
        M.PREEMPTIONS_PER_SECOND: m.get("preemptions_per_s"),
        M.GPU_UTIL_PERCENT: m.get("gpu_util_pct"),
        M.SM_ACTIVE_PERCENT: m.get("sm_active_pct"),
        M.POWER_WATTS: m.get("power_w"),
    }
    running = m.get("max_concurrent_requests")
    if reading.load.kind == "concurrency" and running is not None:
        # A closed loop keeps its users' requests outstanding: those beyond the running batch wait.
        out[M.WAITING_REQUESTS] = max(0.0, reading.load.value - running)
    completed, failed = m.get("completed"), m.get("failed")
    if completed is not None and failed is not None and completed + failed > 0:
        out[M.ERROR_RATE_PERCENT] = 100.0 * failed / (completed + failed)
    else:
        out[M.ERROR_RATE_PERCENT] = 0.0
    return {k: float(v) for k, v in out.items() if v is not None}


def to_outcome(result: TrialResult, objective: Objective) -> TrialOutcome:
    """What the core's search learns from one bench trial: the protocol's conclusion, or the start failure
    classified by the engine adapter as the operator classifies a pod's termination message."""
    if not result.started or result.failure is not None or result.conclusion is None:
        reason = VLLM.classify_failure(result.failure or "") or Reason.CRASH_LOOP_BACK_OFF
        return TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=reason.value,
                            message=(result.failure or "")[:200])
    return result.conclusion.outcome(objective)


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
                return FitVerdict(ok, reason, VLLM.classify_failure(reason) if ok is False else None)

        limits = EngineLimits(max_model_len=scenario.max_model_len)

        def invariant(setting: Setting) -> str | None:
            return VLLM.invariant_violation(setting, limits)

        plan = plan_candidates(core_space, invariant, fit, limits)
        if not plan.candidates:
            return Choice(None, None, plan.error or "empty plan")
        # As the operator (`core.search`): what the memory prefilter pruned enters the history as Infeasible.
        search = Search.start(self.kind, core_space, invariant, plan.pruned, slo, objective, seed, self.max_trials)
        runner = TrialRunner(testbed, scenario, TrialProtocol(headroom_pct=self.headroom_pct))
        history: list[HistoryEntry] = []
        completed: list[CompletedTrial] = []
        claimed: dict[Setting, TrialResult] = {}
        while (setting := search.ask(history)) is not None:
            result = runner.run(_knobs(setting))
            outcome = to_outcome(result, objective)
            history.append((setting, outcome))
            completed.append(CompletedTrial(f"trial-{len(completed)}", setting, outcome))
            claimed[setting] = result
        selection = select_best(completed, objective, slo)
        if selection.best is None:
            return Choice(None, None, selection.reason)
        chosen = claimed[selection.best]
        return Choice(_knobs(selection.best), chosen.claimed_load, selection.reason)


def _knobs(setting: Setting) -> Knobs:
    return Knobs(setting.max_num_seqs, setting.gpu_memory_utilization_percent, setting.max_num_batched_tokens)
