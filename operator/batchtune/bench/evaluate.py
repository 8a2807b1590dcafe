"""Objective of a setting: noise-free for the oracle and regret (`Judge`), measured for a tuning trial
(`operator_trial`, the operator's own trial loop on the simulated GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batchtune.bench.loadsearch import exact_capacity
from batchtune.bench.scenarios import Scenario
from batchtune.bench.testbed import GroundTruth, derive_seed
from batchtune.bench.types import Knobs, Load, Reading, Testbed
from batchtune.core import protocol as core_protocol
from batchtune.core.objective import Objective, objective_value
from batchtune.core.planning import SearchSpace
from batchtune.core.protocol import Conclusion, CurveLoad, ProtocolConfig, RunResult, production_peak_curve_load
from batchtune.core.scrape import DEFAULT_SCRAPE_INTERVAL_SECONDS
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets
from batchtune.core.trial_loop import Run, RunFailure, TrialPlan, run_trial, search_results
from batchtune.core.tuning import (
    Load as LoadSpec,
)
from batchtune.core.tuning import (
    StrategyChoice,
    TrialTiming,
    TuningSpec,
    View,
    view_of,
)
from batchtune.core.vocabulary import M, StepPurpose, Verdict


@dataclass(frozen=True)
class Evaluation:
    """A setting's objective (0 when it cannot start or meets no load) and the load it was found at."""

    knobs: Knobs
    objective: float
    load: Load | None
    reading: Reading | None = None
    failure: str | None = None

    @property
    def feasible(self) -> bool:
        return self.objective > 0


@dataclass
class Judge:
    """Noise-free ground truth for one scenario, cached per setting."""

    scenario: Scenario
    truth: GroundTruth
    window_s: float = 0.0
    """0: the scenario's simulated window (what the trials see)."""
    _cache: dict[Knobs, Evaluation] = field(default_factory=dict)
    _shared: dict[tuple[int, int | None], Evaluation] = field(default_factory=dict)
    evaluations: int = 0

    def measure(self, knobs: Knobs, load: Load, *, seed: int = 0, noise: float = 0.0) -> Reading:
        self.evaluations += 1
        window = self.window_s or self.scenario.window_s
        return self.truth.measure(self.scenario, knobs, load, duration_s=window, seed=seed, noise=noise)

    def objective(self, knobs: Knobs, *, hint: float | None = None) -> Evaluation:
        """`hint`: a neighbouring setting's capacity, where the load search starts (saves steps)."""
        cached = self._cache.get(knobs)
        if cached is not None:
            return cached
        # Where the KV pool holds max-num-seqs full requests it never binds, and the run is the same at
        # every gmu: share one evaluation (exact, not an approximation; memory failures are per setting).
        unbounded = getattr(self.truth, "kv_never_binds", None)
        shared = None
        if unbounded is not None and unbounded(self.scenario, knobs):
            shared = (knobs.max_num_seqs, knobs.max_num_batched_tokens)
        start = self.truth.startup(self.scenario, knobs)
        if start.ok and shared is not None and shared in self._shared:
            base = self._shared[shared]
            burst = getattr(self.truth, "burst_failure", None)
            crash = burst(self.scenario, knobs) if burst is not None else None
            result = Evaluation(knobs, 0.0, None, failure=crash) if crash else Evaluation(
                knobs, base.objective, base.load, base.reading, base.failure)
        else:
            result = self._evaluate(knobs, hint)
            if shared is not None and start.ok and not _memory_failure(result):
                self._shared[shared] = result
        self._cache[knobs] = result
        return result

    def _evaluate(self, knobs: Knobs, hint: float | None) -> Evaluation:
        start = self.truth.startup(self.scenario, knobs)
        if not start.ok:
            return Evaluation(knobs, 0.0, None, failure=start.error)
        burst = getattr(self.truth, "burst_failure", None)
        crash = burst(self.scenario, knobs) if burst is not None else None
        if crash:
            # A server that dies at the first traffic burst is no recommendation, whatever it holds before.
            return Evaluation(knobs, 0.0, None, failure=crash)
        sc = self.scenario
        if sc.objective == "throughput":
            assert sc.load is not None
            reading = self.measure(knobs, sc.load)
            if not reading.ok:
                return Evaluation(knobs, 0.0, None, reading, reading.failure)
            value = reading.get("output_throughput", 0.0) if sc.slo.met_by(reading.metrics) else 0.0
            return Evaluation(knobs, value, sc.load if value > 0 else None, reading)
        failures: list[Reading] = []

        def measure(load: Load) -> Reading:
            reading = self.measure(knobs, load)
            if not reading.ok:
                failures.append(reading)
            return reading

        # A truth with its own capacity search (the recorded engine: only recorded loads) uses it.
        search = getattr(self.truth, "capacity_search", None)
        found = search(measure, sc.slo, sc.load_kind, knobs) if search is not None else exact_capacity(
            measure, sc.slo, sc.load_kind, saturation_concurrency=knobs.max_num_seqs, hint=hint
        )
        if failures:
            return Evaluation(knobs, 0.0, None, failures[0], failures[0].failure)
        if found.reading is None or found.load is None:
            return Evaluation(knobs, 0.0, None, found.reading)
        if sc.load_kind == "request_rate":
            # Open loop: the highest Poisson rate held (a windowed completion count undercounts long requests).
            return Evaluation(knobs, found.load.value, found.load, found.reading)
        # Closed loop: the request throughput sustained at the highest passing concurrency.
        return Evaluation(knobs, max(found.reading.get("request_throughput", 0.0), 0.0), found.load, found.reading)

    def holds(self, knobs: Knobs, load: Load, *, seed: int | None = None, noise: float = 0.0) -> bool:
        """Does the setting meet every SLO at this load (noise-free unless noise and seed are given)?"""
        if not self.truth.startup(self.scenario, knobs).ok:
            return False
        confirming = getattr(self.truth, "confirming_load", None)
        if confirming is not None:
            # A truth that holds only some loads (the recorded engine) confirms a claim at the lowest load it holds at or
            # above it (a closed loop's latency grows with its concurrency); with none, the claim is not confirmed.
            load = confirming(knobs, load)
            if load is None:
                return False
        reading = self.measure(knobs, load, seed=seed or 0, noise=noise)
        return reading.ok and self.scenario.slo.met_by(reading.metrics)

    def noisy_violations(self, knobs: Knobs, load: Load, *, repeats: int, noise: float, seed: int) -> int:
        return sum(
            not self.holds(knobs, load, seed=derive_seed(seed, "recheck", i), noise=noise) for i in range(repeats)
        )


def _memory_failure(evaluation: Evaluation) -> bool:
    return evaluation.failure is not None and "memory" in evaluation.failure.lower()


# ---- a scenario in the operator's terms ---------------------------------------------------------

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
        M.TTFT_MEAN_MS: m.get("mean_ttft_ms"),
        M.ITL_MEAN_MS: m.get("mean_itl_ms"),
        M.OUTPUT_THROUGHPUT: m.get("output_throughput"),
        M.REQUEST_THROUGHPUT: m.get("request_throughput"),
        M.KV_CACHE_USAGE_PERCENT: m.get("kv_cache_usage_pct"),
        M.PREEMPTIONS_PER_SECOND: m.get("preemptions_per_s"),
        M.GPU_UTIL_PERCENT: m.get("gpu_util_pct"),
        M.SM_ACTIVE_PERCENT: m.get("sm_active_pct"),
        M.POWER_WATTS: m.get("power_w"),
        M.RUNNING_REQUESTS: m.get("mean_running_requests"),  # vllm:num_requests_running, averaged
        M.KV_POOL_TOKENS: m.get("kv_cache_tokens"),  # vllm:cache_config_info blocks x block size
    }
    running = m.get("max_concurrent_requests")
    if reading.load.kind == "concurrency" and running is not None:
        # A closed loop keeps its users' requests outstanding: those beyond the running batch wait.
        out[M.WAITING_REQUESTS] = max(0.0, reading.load.value - running)
    completed, failed = m.get("completed"), m.get("failed")
    if completed is not None and scenario.window_s > 0:
        # Requests behind the percentiles, as the load generator counts them, over the billed window (the quick
        # suite simulates a shorter one): too few and the operator runs the load again for longer.
        out[M.SAMPLES] = completed * scenario.measure_s / scenario.window_s
    if completed is not None and failed is not None and completed + failed > 0:
        out[M.ERROR_RATE_PERCENT] = 100.0 * failed / (completed + failed)
    else:
        out[M.ERROR_RATE_PERCENT] = 0.0
    return {k: float(v) for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class TrialProtocol:
    """How an operator-style trial measures a setting: the BatchTuning a user would write for the scenario (the
    `spec.trial` defaults, the SLO headroom a strategy keeps: baselines keep none), read through the operator's own
    view of a spec (`core.tuning.view_of`) at the chart's default scrape interval, so every step, window and
    lengthening is the operator's."""

    headroom_pct: int = 0
    """Latency margin a pass needs (the core's SLO headroom); baselines use 0."""
    repeats: int = 1
    bracketing: bool = True
    """The capacity search's bracketing steps run a short window where the operator's would (`spec.trial.
    bracketSeconds` unset); False: `bracketSeconds: 0`, every step full."""
    curve: bool = True
    """Every Done trial is measured once more at the report's common load, as the operator's default
    (`spec.report.curveLoad` unset: production's peak per replica, else the largest maxNumSeqs planned)."""

    def spec(self, scenario: Scenario, strategy: str = "Adaptive", max_trials: int = 12) -> TuningSpec:
        """The scenario's BatchTuning spec, in core types."""
        capacity = scenario.objective == "capacity"
        open_loop = scenario.load_kind == "request_rate" if capacity else bool(
            scenario.load and scenario.load.kind == "request_rate")
        if capacity:
            rate = _to_int_load("request_rate", scenario.expected_rate) if open_loop else None
            concurrency = None
        else:
            assert scenario.load is not None
            value = _to_int_load(scenario.load.kind, scenario.load.value)
            rate, concurrency = (value, None) if open_loop else (None, value)
        space = scenario.tuner_space
        return TuningSpec(
            Objective.SLO_CAPACITY if capacity else Objective.OUTPUT_THROUGHPUT, slo_targets(scenario, self.headroom_pct),
            SearchSpace(space.max_num_seqs, space.gpu_memory_utilization_pct,
                        tuple(m for m in space.max_num_batched_tokens if m is not None)),
            LoadSpec(scenario.input_len, scenario.output_len, concurrency, rate),
            TrialTiming(measure_seconds=int(scenario.measure_s), repeats=self.repeats,
                        bracket_seconds=None if self.bracketing else 0),
            StrategyChoice(strategy, max_trials))

    def view(self, scenario: Scenario) -> View:
        return view_of(self.spec(scenario), DEFAULT_SCRAPE_INTERVAL_SECONDS)

    def config(self, scenario: Scenario) -> ProtocolConfig:
        return self.view(scenario).protocol

    def curve_load(self, scenario: Scenario) -> CurveLoad | None:
        """The operator's default curve load for this scenario: its open loop's rate as production's peak (one
        replica), else (closed loops, fixed loads) the largest maxNumSeqs planned as a closed loop."""
        if not self.curve:
            return None
        peak = scenario.expected_rate if scenario.objective == "capacity" and scenario.load_kind == "request_rate" \
            else None
        return production_peak_curve_load(peak, 1, max(scenario.tuner_space.max_num_seqs), int(scenario.measure_s))


@dataclass(frozen=True)
class TrialResult:
    """One operator-style trial: start, warm up, then the core's trial loop on the simulated GPU."""

    knobs: Knobs
    started: bool
    objective: float
    """Measured (noisy) objective; 0 when infeasible or the SLO held at no load tried."""
    met: bool
    claimed_load: Load | None
    reading: Reading | None
    failure: str | None = None
    steps: int = 0
    conclusion: Conclusion | None = None
    """The core's conclusion (metrics as the operator's status holds them); None when it did not start."""
    runs: tuple[Run, ...] = ()
    """Every load run the trial loop asked for, in order (lengthened ones and the curve step's included)."""


def _to_int_load(kind: str, value: float) -> int:
    # The protocol's loads are integers: concurrency, or requests per minute for open-loop rates.
    return max(1, int(round(value))) if kind == "concurrency" else max(1, int(round(value * 60)))


def _from_int_load(open_loop: bool, load: int) -> Load:
    return Load("request_rate", load / 60.0) if open_loop else Load("concurrency", float(load))


@dataclass
class TestbedWorld:
    """The trial loop's `World` on a testbed: each run a load step on the running server, its reading in the
    status metric names the core reads."""

    testbed: Testbed
    scenario: Scenario
    plan: TrialPlan
    readings: list[tuple[Run, Reading]] = field(default_factory=list)

    def run(self, run: Run) -> RunResult | RunFailure:
        curve = self.plan.curve if run.purpose is StepPurpose.CURVE else None
        open_loop = curve.open_loop if curve is not None else self.plan.config.open_loop
        reading = self.testbed.run_load(_from_int_load(open_loop, run.load), seconds=run.seconds)
        self.readings.append((run, reading))
        if not reading.ok:
            return RunFailure(reading.failure or "the server failed under load")
        return RunResult(status_metrics(reading, self.scenario, self.plan.config.slo.percentile))

    def search_readings(self) -> dict[int, Reading]:
        """The reading each load of the search counted, the full window's where there is one."""
        out: dict[int, Reading] = {}
        for run, reading in self.readings:
            if run.purpose is not StepPurpose.CURVE and (run.purpose is not StepPurpose.BRACKET or run.load not in out):
                out[run.load] = reading
        return out


def operator_trial(
    testbed: Testbed,
    scenario: Scenario,
    knobs: Knobs,
    *,
    protocol: TrialProtocol = TrialProtocol(),
    neighbours: Sequence[TrialResult] = (),
    predicted: int | None = None,
) -> TrialResult:
    """Start the setting and measure it exactly as the operator does: the operator's trial loop
    (`core.trial_loop.run_trial`) decides every load run (the capacity search warm-started at a twin's predicted
    capacity, else at the nearest finished trial's; short bracketing steps, lengthened runs, the curve step), combines
    repeats, judges the SLO and concludes; the simulated GPU only serves the load and bills it."""
    start = testbed.start(knobs)
    if not start.ok:
        return TrialResult(knobs, False, 0.0, False, None, None, start.error)
    view = protocol.view(scenario)
    config = view.protocol
    found = core_protocol.neighbours_of([(_setting(r.knobs), r.conclusion.metrics)
                                         for r in neighbours if r.met and r.conclusion is not None])
    plan = TrialPlan(_setting(knobs), config, view.windows, tuple(found), protocol.curve_load(scenario), predicted)
    world = TestbedWorld(testbed, scenario, plan)
    finished = run_trial(plan, world)
    runs = tuple(r for r, _ in world.readings)
    readings = world.search_readings()
    if finished.concluded is None:
        # A setting that crashes under any load of its search is no candidate, whatever passed before.
        failing = world.readings[-1][1]
        return TrialResult(knobs, True, 0.0, False, None, failing, failing.failure, len(search_results(finished.steps)) + 1,
                           runs=runs)
    conclusion = finished.concluded.conclusion
    if conclusion.verdict is not Verdict.MET:
        lowest = readings[min(readings)] if readings else None
        return TrialResult(knobs, True, 0.0, False, None, lowest, None, conclusion.steps, conclusion, runs)
    value = objective_value(config.objective, conclusion.metrics) or 0.0
    capacity_load = conclusion.metrics.get(M.SLO_CAPACITY_LOAD)
    if config.searches_capacity and capacity_load is not None:
        load = int(capacity_load)
        claimed = _from_int_load(config.open_loop, load)
        return TrialResult(knobs, True, max(value, 0.0), True, claimed, readings.get(load), None, conclusion.steps,
                           conclusion, runs)
    return TrialResult(knobs, True, max(value, 0.0), True, scenario.load, next(iter(readings.values()), None), None,
                       conclusion.steps, conclusion, runs)


def _setting(knobs: Knobs) -> Setting:
    return Setting(knobs.max_num_seqs, knobs.gpu_memory_utilization_pct, knobs.max_num_batched_tokens)


@dataclass
class TrialRunner:
    """Runs operator-style trials in order, warm-starting each load search at the best capacity so far
    (as the controller does), and keeps them."""

    testbed: Testbed
    scenario: Scenario
    protocol: TrialProtocol = field(default_factory=TrialProtocol)
    results: list[TrialResult] = field(default_factory=list)

    def run(self, knobs: Knobs, predicted: int | None = None) -> TrialResult:
        result = operator_trial(self.testbed, self.scenario, knobs, protocol=self.protocol, neighbours=self.results,
                                predicted=predicted)
        self.results.append(result)
        return result

    def best(self) -> TrialResult | None:
        return max((r for r in self.results if r.met), key=lambda r: r.objective, default=None)
