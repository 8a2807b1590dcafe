"""The BatchTuning's spec in core types (`TuningSpec`, built by the api models' `.core()`), and the view of it every
phase of one tick reads (`View`): the protocol's configuration and the trial windows, derived once.

The api models convert to these types and nothing converts back; the core never sees an api model. The operator
builds the view once per tick from spec, production's measured workload and the install's scrape interval; the
bench builds it from a scenario's spec, so both measure with the same configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchtune.core import protocol
from batchtune.core.objective import Objective
from batchtune.core.planning import SearchSpace
from batchtune.core.protocol import ProtocolConfig
from batchtune.core.retune import RetunePolicy
from batchtune.core.slo import MIN_SAMPLES, SloTargets
from batchtune.core.trial_loop import Windows
from batchtune.core.warmup import WarmupMode
from batchtune.core.workload import WorkloadProfile

SAMPLES_FLOOR = 2 * MIN_SAMPLES
"""Requests the first open-loop step of a capacity search should hold in its window (twice what a verdict needs)."""
TRACE_AS_IS_PERCENT = 100
"""A trace replayed at 100% of its speed is replayed as is (the capacity search may speed it up)."""
BRACKET_SCRAPES = 3
"""A defaulted bracketing window spans at least this many scrape intervals (a rate needs two samples in it)."""


@dataclass(frozen=True)
class Trace:
    """A JSONL trace in a ConfigMap that every load run replays (`spec.load.traceConfigMapRef`)."""

    config_map: str
    key: str = "trace.jsonl"


@dataclass(frozen=True)
class Load:
    """`spec.load`: the load driven at each trial."""

    input_tokens: int = 512
    output_tokens: int = 128
    concurrency: int | None = None
    requests_per_minute: int | None = None
    num_prompts: int | None = None
    from_production: bool = False
    trace: Trace | None = None
    builtin_generator: bool = True
    """The project's own load generator (False: `vllm bench serve`)."""
    image: str | None = None


@dataclass(frozen=True)
class TrialTiming:
    """`spec.trial`: how long each part of a trial takes."""

    warmup_seconds: int = 30
    warmup: WarmupMode = WarmupMode.STEADY
    measure_seconds: int = 60
    readiness_timeout_seconds: int = 900
    repeats: int = 1
    bracket_seconds: int | None = None
    """spec.trial.bracketSeconds: None the default, 0 off."""


@dataclass(frozen=True)
class StrategyChoice:
    """`spec.strategy`: which search, with its seed and budgets."""

    kind: str = "Adaptive"
    max_trials: int = 12
    max_parallel_trials: int = 1
    seed: int = 0
    max_gpu_minutes: int | None = None


@dataclass(frozen=True)
class TuningSpec:
    """What the operator and the bench read of a BatchTuning's spec, in core types."""

    objective: Objective
    slo: SloTargets
    space: SearchSpace
    load: Load
    trial: TrialTiming
    strategy: StrategyChoice
    extra_args: tuple[str, ...] = ()
    retune: RetunePolicy | None = None


@dataclass(frozen=True)
class View:
    """One tick's reading of the spec: the spec in core types and what is derived from it (built once per tick)."""

    spec: TuningSpec
    protocol: ProtocolConfig
    windows: Windows
    workload: WorkloadProfile | None = None
    """Production's measured workload, when the tuning drives it (spec.load.fromProduction)."""
    input_tokens: int = 512
    """Mean prompt tokens of the load the trials drive (production's measured mean, else spec.load's)."""
    output_tokens: int = 128

    @property
    def objective(self) -> Objective:
        return self.spec.objective

    @property
    def slo(self) -> SloTargets:
        return self.spec.slo


def view_of(spec: TuningSpec, scrape_interval_seconds: float | None = None, workload: WorkloadProfile | None = None,
         input_tokens: int | None = None, output_tokens: int | None = None) -> View:
    """The view of `spec` for one tick. `scrape_interval_seconds`: the install's (None: no bracketing, every step
    full); `workload`: production's measured profile; `input_tokens`/`output_tokens`: the mean lengths status.workload
    holds (None: spec.load's)."""
    bracket = bracket_window(spec, scrape_interval_seconds) if scrape_interval_seconds is not None else None
    measured = workload if spec.load.from_production else None
    return View(spec, protocol_config(spec, measured, bracket is not None),
                Windows(spec.trial.measure_seconds, bracket, counted=bool(spec.load.num_prompts)), measured,
                input_tokens or spec.load.input_tokens, output_tokens or spec.load.output_tokens)


def protocol_config(spec: TuningSpec, workload: WorkloadProfile | None, bracketing: bool = False) -> ProtocolConfig:
    """How this tuning measures its trials.

    With fromProduction and neither concurrency nor requestsPerMinute, the load is open loop at production's own peak
    rate per replica (a trial is one replica; a capacity search starts there), with its burstiness."""
    load = spec.load
    rate = load.requests_per_minute
    peak = workload.peak_per_replica() if workload is not None else None
    first = None
    if rate is None and load.concurrency is None and load.from_production and peak:
        rate = max(1, round(peak * 60))
        if spec.objective.searches_capacity and not load.num_prompts:
            # A quiet production's peak would give a first step too few requests to judge (Unknown): the search
            # starts where one window holds enough of them, and walks down if that fails.
            first = max(rate, math.ceil(SAMPLES_FLOOR * 60 / spec.trial.measure_seconds))
    trace = load.trace is not None
    if trace:
        rate = TRACE_AS_IS_PERCENT  # a trace's loads are percent of its own speed
    fixed = rate if rate is not None else load.concurrency
    return ProtocolConfig(objective=spec.objective, slo=spec.slo, open_loop=rate is not None,
                          repeats=spec.trial.repeats, fixed_load=fixed, first_load=first or fixed, trace=trace,
                          bracketing=bracketing)


def bracket_window(spec: TuningSpec, scrape_interval_seconds: float) -> int | None:
    """The window of the search's short steps, or None when every step runs measureSeconds (numPrompts runs are
    counted, not timed)."""
    if spec.load.num_prompts:
        return None
    return protocol.bracket_seconds(spec.trial.measure_seconds, spec.trial.bracket_seconds,
                                    BRACKET_SCRAPES * scrape_interval_seconds)


def goodput_targets(slo: SloTargets) -> tuple[tuple[str, int], ...]:
    """The SLO's targets, per request, in the load generators' goodput terms (ITL is a request's TPOT)."""
    pairs = (("ttft", slo.ttft_ms), ("tpot", slo.itl_ms), ("e2el", slo.e2e_ms))
    return tuple((key, ms) for key, ms in pairs if ms is not None)
