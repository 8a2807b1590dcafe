"""The simulated GPU a strategy tunes on: starts servers, offers load, and bills every second of it."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from batchtune.bench.types import Knobs, Load, Reading, StartResult
from batchtune.core.warmup import GROWTH_TOLERANCE, RATE_TOLERANCE, STEADY_CHECK_S, STEADY_MIN_S, STEADY_SPAN_CHECKS

if TYPE_CHECKING:
    from batchtune.bench.scenarios import Scenario
    from batchtune.core.burst import Burst


class GroundTruth(Protocol):
    """The model of vLLM on a GPU the benchmark runs against (the twin, or a synthetic one in tests)."""

    def startup(self, scenario: Scenario, knobs: Knobs) -> StartResult: ...

    def measure(
        self, scenario: Scenario, knobs: Knobs, load: Load, *, duration_s: float, seed: int, noise: float,
        prompts: int | None = None, warmup_s: float | None = None,
    ) -> Reading:
        """One load step: a `duration_s` measured window, or with `prompts` a whole `vllm bench serve
        --num-prompts N` run (metrics `duration`, `completed` as the bench reports them). `warmup_s`: the load
        before the window (None: the truth's own default)."""
        ...


JOB_START_S = 5.0
"""A load Job's creation to its window's start, less the warm-up: the pod's start and the load generator's start-up
(median 4.9 s over 14 runs on the local cluster; docs/benchmarks.md, "Cost model")."""
TICK_S = 2.0
"""The chart's operator.tickSeconds."""
TICKS_AFTER_A_RUN = 2.9
"""Ticks from a run's window end, past the scrape lag, to the next Job's creation: the tick that reads the run, the
one that records the next step's intent, the one that creates its Job (7.9 s measured at 1 s ticks and a 5 s lag)."""
SCRAPE_LAG_S = 6.0 + TICKS_AFTER_A_RUN * TICK_S
"""The operator's scrape lag (BATCHTUNE_SCRAPE_LAG_SECONDS, 6 s by default) and those ticks at the chart's tick."""


@dataclass(frozen=True)
class CostModel:
    """How long each step of a tuning run keeps the GPUs busy (seconds of wall time on every GPU)."""

    warmup_s: float = 30.0
    """Warm-up load of every operator load step (`spec.trial.warmupSeconds`): the first after a server start pays it
    in full, the later ones on the warm server the steady-state time (`steady_warmup_seconds`)."""
    steady_warmup: bool = True
    """Later steps end their warm-up at the steady-state test (`spec.trial.warmup: Steady`, the default); False:
    every step pays `warmup_s` (`Fixed`)."""
    drain_s_cap: float = 120.0
    """A prompt-counted run (`vllm bench serve --num-prompts N`) ends when the last request finishes; cap the tail."""
    job_start_s: float = JOB_START_S
    """Every operator load run before its warm-up: the tick that creates its Job, the Job's pod start and the load
    generator's start-up (the trial's GPUs are held meanwhile)."""
    scrape_lag_s: float = SCRAPE_LAG_S
    """Every operator load run after its window: the install's scrape lag and the ticks until the next run's Job (a
    trial's last run ends sooner, at the reading tick: billed the same, a few seconds over, alike for every strategy)."""


@dataclass
class Ledger:
    """What one strategy spent on one scenario."""

    starts: int = 0
    failed_starts: int = 0
    load_steps: int = 0
    runtime_failures: int = 0
    gpu_seconds: float = 0.0
    wall_seconds: float = 0.0
    lower_load_steps: int = 0
    """Load steps the truth served at another load than asked (the recorded engine: the next lower recorded
    concurrency), each billed as the step asked for."""

    @property
    def gpu_minutes(self) -> float:
        return self.gpu_seconds / 60.0


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any labels (hash() is salted per process, so not usable here)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass
class SimTestbed:
    """A `Testbed` over a ground truth with seeded measurement noise and a cost ledger.

    Common random numbers: a reading's noise is keyed by what was measured, never by when. The key is the world
    (`seed`, the scenario, the truth's `truth_seed`), the setting, the load step (load, window, prompts, warm-up) and
    its repeat index (how often this testbed measured that very step before), so every strategy measuring the same
    step the same n-th time in the same world gets the identical reading, whatever it asked before.
    """

    scenario: Scenario
    truth: GroundTruth
    seed: int
    noise: float
    cost: CostModel = field(default_factory=CostModel)
    ledger: Ledger = field(default_factory=Ledger)
    _running: Knobs | None = None
    _warm: bool = False
    _repeats: dict[tuple[object, ...], int] = field(default_factory=dict)

    @property
    def running(self) -> Knobs | None:
        return self._running

    def _charge(self, seconds: float) -> None:
        self.ledger.wall_seconds += seconds
        self.ledger.gpu_seconds += seconds * self.scenario.gpus

    def start(self, knobs: Knobs) -> StartResult:
        result = self.truth.startup(self.scenario, knobs)
        self.ledger.starts += 1
        self._charge(result.seconds)
        if not result.ok:
            self.ledger.failed_starts += 1
            self._running = None
            return result
        self._running = knobs
        self._warm = False
        return result

    def run_load(self, load: Load, *, prompts: int | None = None, warmup: bool = True,
                 seconds: float | None = None) -> Reading:
        """One load step on the running server. Operator-style steps (prompts=None) are a load Job each: its start
        (`job_start_s`), its warm-up (the first after a start the full `warmup_s`, later ones the steady-state
        time), the scenario's `measure_s` or `seconds` (a bracketing step's shorter window, a lengthened run's
        longer one), then the scrape lag (`scrape_lag_s`); prompt-counted steps last until the N-th request
        completes. Another window simulates proportionally more or less time, with run-to-run noise as 1/sqrt of
        its length."""
        if self._running is None:
            raise RuntimeError("run_load needs a started server; call start() first and check its result")
        warm = self._warm
        if prompts is None and warmup:
            self._warm = True
        full = self.scenario.measure_s
        fraction = seconds / full if prompts is None and seconds is not None and seconds > 0 else 1.0
        seed = self._noise_seed("load", self._running.label(), load.kind, repr(load.value), repr(fraction), prompts,
                                warmup)
        # The load before the window is what an operator step gets: up to spec.trial.warmupSeconds, or until the
        # steady-state test passes, which by its definition leaves the queue settled either way.
        reading = self.truth.measure(
            self.scenario, self._running, load, duration_s=self.scenario.window_s * fraction, seed=seed,
            noise=self.noise / math.sqrt(fraction), prompts=prompts,
            warmup_s=self.cost.warmup_s if prompts is None and warmup else None,
        )
        self.ledger.load_steps += 1
        if reading.load != load:
            self.ledger.lower_load_steps += 1
        if prompts is None and warmup:  # billed as the operator runs each step: a load Job of its own
            self._charge(self.cost.job_start_s + self.cost.scrape_lag_s)
            self._charge(steady_warmup_seconds(reading, self.cost.warmup_s)
                         if warm and self.cost.steady_warmup else self.cost.warmup_s)
        if prompts is None:
            seconds = full * fraction
        else:
            seconds = prompt_run_seconds(reading, prompts, self.cost.drain_s_cap)
        self._charge(seconds)
        if not reading.ok:
            # A runtime failure (CUDA OOM) kills the server: the next step needs a new start.
            self.ledger.runtime_failures += 1
            self._running = None
        return Reading(reading.load, reading.metrics, reading.failure, seconds)

    def _noise_seed(self, *step: object) -> int:
        """The seed of one step's noise: the world, the step, and the step's repeat index (common random numbers)."""
        repeat = self._repeats.get(step, 0)
        self._repeats[step] = repeat + 1
        return derive_seed(self.seed, self.scenario.name, getattr(self.truth, "truth_seed", None), *step, repeat)

    def run_burst(self, burst: Burst) -> Reading:
        """A burst probe on the running server (`core.burst`): its requests sent at once with the burst's lengths, run
        to the last completion, billed as a load Job (its start and the scrape lag besides the run)."""
        if self._running is None:
            raise RuntimeError("run_burst needs a started server; call start() first and check its result")
        seed = self._noise_seed("burst", self._running.label(), burst.concurrency, burst.prompt_tokens,
                                burst.output_tokens)
        shaped = replace(self.scenario, input_len=burst.prompt_tokens, output_len=burst.output_tokens)
        load = Load("concurrency", float(burst.concurrency))
        reading = self.truth.measure(shaped, self._running, load, duration_s=self.scenario.window_s, seed=seed,
                                     noise=self.noise, prompts=burst.concurrency)
        self.ledger.load_steps += 1
        seconds = prompt_run_seconds(reading, burst.concurrency, self.cost.drain_s_cap)
        self._charge(self.cost.job_start_s + self.cost.scrape_lag_s + seconds)
        if not reading.ok:
            self.ledger.runtime_failures += 1
            self._running = None
        return Reading(reading.load, reading.metrics, reading.failure, seconds)


def steady_warmup_seconds(reading: Reading, warmup_s: float) -> float:
    """How long the load generator's steady-state test (core/warmup.py) lets a step on a warm server warm up,
    modelled from the step's own reading, at most `warmup_s`; docs/benchmarks.md compares it with the real test.

    - A closed loop holds its streams from the start: it settles at the test's minimum (STEADY_MIN_S) or, when
      requests take longer, at the first completion (about one service time, E2E latency less TTFT), then a check.
    - An open loop fills its queue for about one E2E latency, then the test needs its two spans (STEADY_MIN_S);
      Poisson arrivals make both spans noisy, so it passes a check with a probability `p` (the rate within
      RATE_TOLERANCE, the queue within its growth allowance) and waits about 2 * (1 - p) / p checks more.
    - An open loop that completed clearly fewer than (1 - GROWTH_TOLERANCE) of its arrivals keeps growing its
      queue and never settles: the full `warmup_s`, as does a failed or unreadable step.
    """
    e2el_s = reading.get("mean_e2el_ms") / 1000.0
    ttft_s = reading.get("mean_ttft_ms", 0.0) / 1000.0
    if not reading.ok or not e2el_s >= 0:
        return warmup_s
    if reading.load.kind == "concurrency" or not math.isfinite(reading.load.value):
        settles = max(STEADY_MIN_S, e2el_s - (ttft_s if ttft_s >= 0 else 0.0)) + STEADY_CHECK_S
    else:
        rate = reading.load.value
        window_s = reading.get("duration", 60.0)
        arrivals = rate * (window_s if window_s > 0 else 60.0)
        completed = reading.get("request_throughput", 0.0) * (window_s if window_s > 0 else 60.0)
        if not completed >= (1.0 - GROWTH_TOLERANCE) * arrivals - 2.0 * math.sqrt(arrivals):
            return warmup_s
        span_s = STEADY_SPAN_CHECKS * STEADY_CHECK_S
        spread = math.sqrt(2.0 / (rate * (span_s + e2el_s)))  # of the two spans' rate difference, relative
        in_flight = rate * e2el_s
        p = (math.erf(RATE_TOLERANCE / spread / math.sqrt(2.0))
             * _normal_cdf(max(1.0, GROWTH_TOLERANCE * 2 * span_s * rate) / math.sqrt(max(2.0 * in_flight, 1e-9))))
        settles = e2el_s + STEADY_MIN_S + 2.0 * STEADY_CHECK_S * (1.0 - p) / max(p, 1e-3)
    return min(warmup_s, math.ceil(settles / STEADY_CHECK_S) * STEADY_CHECK_S)


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def prompt_run_seconds(reading: Reading, prompts: int, drain_cap_s: float) -> float:
    """Wall time of `--num-prompts N`: the bench's own duration when it ran to the end, else N requests
    at the achieved request rate plus the last one's latency."""
    duration = reading.get("duration", math.nan)
    if reading.ok and reading.get("completed", 0.0) >= prompts and duration > 0:
        return duration
    rps = reading.get("request_throughput", 0.0)
    if not reading.ok or not rps > 0 or math.isnan(rps):
        return 30.0  # a failed run still cost the time to notice it
    tail_s = min(reading.get("mean_e2el_ms", 0.0) / 1000.0, drain_cap_s)
    if math.isnan(tail_s):
        tail_s = 0.0
    return prompts / rps + tail_s
