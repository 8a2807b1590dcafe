"""Objective of a setting: noise-free for the oracle and regret (`Judge`), measured for a tuning trial
(`operator_trial`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from batchtune.bench.loadsearch import exact_capacity
from batchtune.bench.scenarios import Scenario
from batchtune.bench.testbed import GroundTruth, derive_seed
from batchtune.bench.types import Knobs, Load, Reading, Slo, Testbed

# The simulated window of a noise-free judgement: long enough for the queue to show past capacity.
JUDGE_WINDOW_S = 120.0


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
    window_s: float = JUDGE_WINDOW_S
    _cache: dict[Knobs, Evaluation] = field(default_factory=dict)
    evaluations: int = 0

    def measure(self, knobs: Knobs, load: Load, *, seed: int = 0, noise: float = 0.0) -> Reading:
        self.evaluations += 1
        return self.truth.measure(self.scenario, knobs, load, duration_s=self.window_s, seed=seed, noise=noise)

    def objective(self, knobs: Knobs) -> Evaluation:
        cached = self._cache.get(knobs)
        if cached is None:
            cached = self._evaluate(knobs)
            self._cache[knobs] = cached
        return cached

    def _evaluate(self, knobs: Knobs) -> Evaluation:
        start = self.truth.startup(self.scenario, knobs)
        if not start.ok:
            return Evaluation(knobs, 0.0, None, failure=start.error)
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

        found = exact_capacity(measure, sc.slo, sc.load_kind, saturation_concurrency=knobs.max_num_seqs)
        if failures:
            return Evaluation(knobs, 0.0, None, failures[0], failures[0].failure)
        return Evaluation(knobs, found.value, found.load, found.reading)

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
    start_hint: Load | None = None,
) -> TrialResult:
    """Start the setting and measure it as the operator does. For SLO capacity: the controller's
    load search from `start_hint` (the best capacity so far) or the batch size / 1 req/s."""
    from batchtune.controller.loadsearch import LoadStep, SearchBounds, capacity, next_load

    start = testbed.start(knobs)
    if not start.ok:
        return TrialResult(knobs, False, 0.0, False, None, None, start.error)
    dead: list[Reading] = []

    def measure(load: Load) -> Reading:
        # Repeats average nothing here; each is billed and the worst reading decides, as a cautious operator would.
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
    if start_hint is not None and start_hint.kind == kind:
        first = _to_int_load(kind, start_hint.value)
    else:
        first = knobs.max_num_seqs if kind == "concurrency" else 60
    bounds = SearchBounds(start=first, max_steps=protocol.max_load_steps, resolution=protocol.resolution)
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
    best = capacity(steps)
    if best is None:
        return TrialResult(knobs, True, 0.0, False, None, None, None, len(steps))
    claimed = _from_int_load(kind, best.load)
    return TrialResult(knobs, True, claimed.value, True, claimed, readings[best.load], None, len(steps))


@dataclass
class TrialRunner:
    """Runs operator-style trials in order, warm-starting each load search at the best capacity so far
    (as the controller does), and keeps them."""

    testbed: Testbed
    scenario: Scenario
    protocol: TrialProtocol = field(default_factory=TrialProtocol)
    results: list[TrialResult] = field(default_factory=list)

    def run(self, knobs: Knobs) -> TrialResult:
        hint = max((r for r in self.results if r.met), key=lambda r: r.objective, default=None)
        result = operator_trial(
            self.testbed, self.scenario, knobs, protocol=self.protocol,
            start_hint=hint.claimed_load if hint is not None else None,
        )
        self.results.append(result)
        return result

    def best(self) -> TrialResult | None:
        return max((r for r in self.results if r.met), key=lambda r: r.objective, default=None)
