"""Objective of a setting: noise-free for the oracle and regret (`Judge`), measured for a tuning trial
(`operator_trial`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from batchtune.bench.loadsearch import exact_capacity
from batchtune.bench.scenarios import Scenario
from batchtune.bench.testbed import GroundTruth, derive_seed
from batchtune.bench.types import Knobs, Load, Reading, Slo, Testbed


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

        found = exact_capacity(
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
        reading = self.measure(knobs, load, seed=seed or 0, noise=noise)
        return reading.ok and self.scenario.slo.met_by(reading.metrics)

    def noisy_violations(self, knobs: Knobs, load: Load, *, repeats: int, noise: float, seed: int) -> int:
        return sum(
            not self.holds(knobs, load, seed=derive_seed(seed, "recheck", i), noise=noise) for i in range(repeats)
        )


def _memory_failure(evaluation: Evaluation) -> bool:
    return evaluation.failure is not None and "memory" in evaluation.failure.lower()


@dataclass(frozen=True)
class TrialProtocol:
    """How an operator-style trial measures a setting (the BatchTuning `spec.trial` defaults and the
    controller's load search: at most 5 load steps, 10% resolution)."""

    max_load_steps: int = 5
    resolution: float = 0.1
    headroom_pct: int = 0
    """Latency margin a pass needs (the core's SLO headroom); baselines use 0."""
    repeats: int = 1


@dataclass(frozen=True)
class TrialResult:
    """One operator-style trial: start, warm up, then measure the objective under the SLO."""

    knobs: Knobs
    started: bool
    objective: float
    """Measured (noisy) objective; 0 when infeasible or the SLO held at no load tried."""
    met: bool
    claimed_load: Load | None
    reading: Reading | None
    failure: str | None = None
    steps: int = 0
    kv_usage_peak_pct: float | None = None
    """Highest KV-cache usage over the trial's load steps (the operator's `kvCacheUsagePeakPercent`)."""
    preemptions_peak_per_s: float | None = None
    """Highest preemption rate over the trial's load steps (`preemptionsPeakPerSecond`)."""


def slo_margin(slo: Slo, metrics: Mapping[str, float] | None, headroom_pct: int = 0) -> float:
    """Worst (limit - value) / limit over the SLO's keys, the limit less the headroom; >= 0 passes,
    -inf when a metric is missing."""
    if not metrics:
        return -math.inf
    worst = math.inf
    for key, target in slo.limits.items():
        value = metrics.get(key)
        if value is None or not math.isfinite(value):
            return -math.inf
        limit = target * (100 - headroom_pct) / 100
        worst = min(worst, (limit - value) / limit)
    return worst


def _to_int_load(kind: str, value: float) -> int:
    # The controller's loads are integers: concurrency, or requests per minute for open-loop rates.
    return max(1, int(round(value))) if kind == "concurrency" else max(1, int(round(value * 60)))


def _from_int_load(kind: str, load: int) -> Load:
    return Load("concurrency", float(load)) if kind == "concurrency" else Load("request_rate", load / 60.0)


def operator_trial(
    testbed: Testbed,
    scenario: Scenario,
    knobs: Knobs,
    *,
    protocol: TrialProtocol = TrialProtocol(),
    neighbours: Sequence[TrialResult] = (),
) -> TrialResult:
    """Start the setting and measure it as the operator does (controller `flow`/`tuning`): for SLO
    capacity, the controller's load search, warm-started at the nearest finished trial's capacity load
    (scaled by max-num-seqs on a closed loop), capped at twice the batch on a closed loop; the objective
    is the request throughput at the highest passing load (`sloCapacity`)."""
    from batchtune.controller.loadsearch import LoadStep, SearchBounds, capacity, next_load

    start = testbed.start(knobs)
    if not start.ok:
        return TrialResult(knobs, False, 0.0, False, None, None, start.error)
    dead: list[Reading] = []

    def measure(load: Load) -> Reading:
        # Repeats: each is billed and the worst reading decides (the controller's worst-case combine).
        readings = []
        for _ in range(protocol.repeats):
            reading = testbed.run_load(load)
            if not reading.ok:
                dead.append(reading)
                return reading
            readings.append(reading)
        return min(readings, key=lambda r: slo_margin(scenario.slo, r.metrics, protocol.headroom_pct))

    if scenario.objective == "throughput":
        assert scenario.load is not None
        reading = measure(scenario.load)
        if dead:
            return TrialResult(knobs, True, 0.0, False, None, reading, reading.failure, 1)
        met = slo_margin(scenario.slo, reading.metrics, protocol.headroom_pct) >= 0
        value = reading.get("output_throughput", 0.0)
        return TrialResult(knobs, True, value if met else 0.0, met, scenario.load if met else None, reading, None, 1)

    kind = scenario.load_kind
    bounds = SearchBounds(
        start=_capacity_start(scenario, knobs, neighbours),
        highest=10_000_000 if kind == "request_rate" else max(2, 2 * knobs.max_num_seqs),
        max_steps=protocol.max_load_steps, resolution=protocol.resolution,
    )
    steps: list[LoadStep] = []
    readings: dict[int, Reading] = {}
    while (load := next_load(steps, bounds)) is not None:
        reading = measure(_from_int_load(kind, load))
        if dead:
            # A setting that crashes under any tried load is no candidate, whatever passed before.
            return TrialResult(knobs, True, 0.0, False, None, reading, reading.failure, len(steps) + 1)
        margin = slo_margin(scenario.slo, reading.metrics, protocol.headroom_pct)
        throughput = reading.get("request_throughput", 0.0)
        steps.append(LoadStep(load, margin >= 0, margin if math.isfinite(margin) else -1e9, throughput))
        readings[load] = reading
    kv_peak, preemption_peak = _peak(readings.values(), "kv_cache_usage_pct"), _peak(readings.values(), "preemptions_per_s")
    best = capacity(steps)
    if best is None:
        # The controller reports a trial with no passing load by its lowest load step.
        lowest = readings[min(readings)] if readings else None
        return TrialResult(knobs, True, 0.0, False, None, lowest, None, len(steps), kv_peak, preemption_peak)
    reading = readings[best.load]
    value = max(reading.get("request_throughput", 0.0), 0.0)
    return TrialResult(knobs, True, value, True, _from_int_load(kind, best.load), reading, None, len(steps),
                       kv_peak, preemption_peak)


def _peak(readings, key: str) -> float | None:
    values = [v for r in readings if math.isfinite(v := r.get(key))]
    return max(values) if values else None


def _capacity_start(scenario: Scenario, knobs: Knobs, neighbours: Sequence[TrialResult]) -> int:
    """The controller's `capacity_start`."""
    kind = scenario.load_kind
    found = [
        (abs(math.log2(r.knobs.max_num_seqs / knobs.max_num_seqs)), r.knobs.max_num_seqs, r.claimed_load.value)
        for r in neighbours if r.met and r.claimed_load is not None
    ]
    if found:
        _, their_seqs, cap = min(found)
        scale = 1.0 if kind == "request_rate" else min(knobs.max_num_seqs / their_seqs, 2.0)
        return max(1, int(_to_int_load(kind, cap) * max(scale, 0.5)))
    if kind == "request_rate":
        return _to_int_load(kind, scenario.expected_rate)
    return max(1, knobs.max_num_seqs // 2)


@dataclass
class TrialRunner:
    """Runs operator-style trials in order, warm-starting each load search at the best capacity so far
    (as the controller does), and keeps them."""

    testbed: Testbed
    scenario: Scenario
    protocol: TrialProtocol = field(default_factory=TrialProtocol)
    results: list[TrialResult] = field(default_factory=list)

    def run(self, knobs: Knobs) -> TrialResult:
        result = operator_trial(self.testbed, self.scenario, knobs, protocol=self.protocol, neighbours=self.results)
        self.results.append(result)
        return result

    def best(self) -> TrialResult | None:
        return max((r for r in self.results if r.met), key=lambda r: r.objective, default=None)
