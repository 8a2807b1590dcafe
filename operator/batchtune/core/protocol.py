"""The trial protocol: one trial from "ready" to "outcome", the same for the operator and the bench.

A trial is a sequence of load steps. Each step runs `repeats` load runs at one offered load; the worst
run decides the step (`close_step`). With the SloCapacity objective the steps search for the highest
load that meets every SLO (`next_load`: bracket by extrapolating the SLO margin, then interpolate, as
vLLM's `serve_sla` sweep does, in at most `max_steps` runs, warm-started from a neighbouring trial's
capacity); otherwise one step at a fixed load. `conclude` turns the steps into the trial's metrics,
verdict and reason. Nothing here does I/O or reads a clock: the operator drives it across reconcile
ticks from status, the bench in a loop on its simulated GPU.

Bracketing steps are short (`ProtocolConfig.bracketing`): while the search is still looking for the
capacity each step runs a brief window (the caller's `bracket_seconds`), and only the load the search
settles on is measured for the full window before it can be the trial's capacity (`conclude` counts only
full-window passes). A short window can read a load as passing before its queue has grown; a full step
that fails where a short one passed makes the rest of the trial's steps full.

A tuning may also measure every trial at one common offered load (`CurveLoad`, `next_step`), so the
report's utilization, throughput and latency curves compare settings under the same load rather than
each at its own capacity. That step is for the picture only: it runs after the search has concluded what
it needs and never enters `next_load`, `conclude` or the peaks (callers pass only search steps there).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from batchtune.core.objective import Objective, objective_value
from batchtune.core.outcomes import StepObservation, TrialOutcome
from batchtune.core.settings import Setting
from batchtune.core.slo import MIN_SAMPLES, SloTargets, evaluate_slo
from batchtune.core.vocabulary import M, Reason, TrialState, Verdict

MAX_LOAD_STEPS = 5
RESOLUTION = 0.1
"""The search stops when the highest pass sits within this fraction of the SLO limit, or of the lowest fail."""
OPEN_LOOP_CEILING = 10_000_000
MAX_LENGTHENING = 4
"""A run with too few requests to judge is run again longer, up to this many times spec.trial.measureSeconds."""
BRACKET_FRACTION = 0.25
"""A bracketing step's window, as a fraction of the full one (by default)."""
MIN_BRACKET_SECONDS = 5
MAX_CONFIRMATIONS = 2
"""Full-window re-runs of a load a short step passed at, per trial (the search's step budget aside)."""
EXTRA_STEPS_WHEN_MISLED = 2
"""Search steps added once a full window failed where a short one passed (its capacity lies lower)."""
MAX_STEPS_PER_TRIAL = MAX_LOAD_STEPS + EXTRA_STEPS_WHEN_MISLED + MAX_CONFIRMATIONS + 1
"""Every step a trial can run: its settled search steps, the short ones its confirmations re-measured, the curve step
(what status keeps of a running trial, `api.models.MAX_STEPS_IN_STATUS`)."""

# Worst case over repeats: the highest latency/error/queue, the lowest throughput, the mean of the rest.
HIGHER_IS_WORSE = frozenset({
    M.TTFT_MS, M.ITL_MS, M.E2E_MS, M.QUEUE_MS, M.TTFT_MEAN_MS, M.ITL_MEAN_MS, M.ERROR_RATE_PERCENT, M.PREEMPTIONS_PER_SECOND,
    M.KV_CACHE_USAGE_PERCENT, M.KV_CACHE_USAGE_MAX_PERCENT, M.WAITING_REQUESTS, M.WAITING_GROWTH,
    M.IN_FLIGHT, M.TTFT_HISTOGRAM_MS, M.ITL_HISTOGRAM_MS, M.E2E_HISTOGRAM_MS,
})
LOWER_IS_WORSE = frozenset({M.REQUEST_THROUGHPUT, M.OUTPUT_THROUGHPUT, M.PROMPT_THROUGHPUT, M.SAMPLES, M.GOODPUT})

# Trial metric <- step metrics it is the peak of, over every measured step: the capacity step's own
# KV usage sits below where the cache binds, the failing step above it shows the binding (Adaptive's gmu gate).
PEAKS = {M.KV_CACHE_USAGE_PEAK_PERCENT: (M.KV_CACHE_USAGE_MAX_PERCENT, M.KV_CACHE_USAGE_PERCENT),
         M.PREEMPTIONS_PEAK_PER_SECOND: (M.PREEMPTIONS_PER_SECOND,)}


@dataclass(frozen=True)
class ProtocolConfig:
    """How trials are measured (from `spec.objective`, `spec.slo`, `spec.load`, `spec.trial`)."""

    objective: Objective
    slo: SloTargets
    open_loop: bool
    """Open loop: loads are requests per minute (Poisson or bursty arrivals); closed: concurrent requests."""
    repeats: int = 1
    max_steps: int = MAX_LOAD_STEPS
    resolution: float = RESOLUTION
    fixed_load: int | None = None
    """The load of the single step of a non-capacity objective; None: the trial's max-num-seqs (closed loop)."""
    first_load: int | None = None
    """The capacity search's first load when no neighbour has a capacity yet; None: half the batch (closed)."""
    trace: bool = False
    """Loads are percent of a trace's own speed (100: replayed as is), not requests per minute."""
    bracketing: bool = False
    """The capacity search's steps run a short window until it settles; only its capacity step runs the full one."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats {self.repeats!r} must be >= 1")
        if self.max_steps < 1:
            raise ValueError(f"max_steps {self.max_steps!r} must be >= 1")
        if self.open_loop and not self.objective.searches_capacity and self.fixed_load is None:
            raise ValueError("an open loop at a fixed load needs fixed_load (requests per minute)")

    @property
    def searches_capacity(self) -> bool:
        return self.objective.searches_capacity

    @property
    def unit(self) -> str:
        if self.trace:
            return "% of the trace's speed"
        return "requests/min" if self.open_loop else "concurrent requests"


@dataclass(frozen=True)
class RunResult:
    """What one load run measured (status metric keys), and where its two sources disagreed."""

    metrics: Mapping[str, float]
    cross_check: str | None = None


@dataclass(frozen=True)
class StepResult:
    """A closed load step: the worst case over its runs, judged against the SLO."""

    load: int
    metrics: Mapping[str, float]
    verdict: Verdict
    verdict_reason: str
    margin: float
    """Worst relative margin under the headroom-adjusted limits; negative when a limit is exceeded."""
    cross_check: str | None = None
    full: bool = True
    """Measured for the full window; False: a short bracketing step (never a trial's capacity on its own)."""

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.MET


@dataclass(frozen=True)
class Neighbour:
    """A finished trial's capacity, where a new trial's search starts."""

    setting: Setting
    capacity_load: int


@dataclass(frozen=True)
class Conclusion:
    """A measured trial: its metrics (the deciding step's, plus peaks and derived figures) and verdict."""

    metrics: Mapping[str, float]
    verdict: Verdict
    verdict_reason: str
    reason: Reason
    message: str
    steps: int = 0
    observations: tuple[StepObservation, ...] = ()
    """Every closed step (load, metrics, verdict): what a twin calibrates on."""

    def outcome(self, objective: Objective) -> TrialOutcome:
        """What the search learns from this trial."""
        return TrialOutcome(TrialState.DONE, self.verdict, objective_value(objective, self.metrics),
                            self.metrics, self.reason.value, self.message, self.observations)


@dataclass(frozen=True)
class SearchBounds:
    start: int
    lowest: int = 1
    highest: int = 1 << 20
    max_steps: int = MAX_LOAD_STEPS
    resolution: float = RESOLUTION
    min_samples: int = MIN_SAMPLES
    """Fewer requests than this behind a step's percentiles is no verdict (`too_few_requests`)."""


# ---- a step ----------------------------------------------------------------------------------


def worst_case(samples: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One metrics mapping from several runs of the same step: the worst of each figure.

    A run missing a figure does not drop out: the figure is the worst of those that have it, and a
    run's missing error rate makes the step's error rate unknown (it cannot be shown to be low).
    """
    keys = {k for s in samples for k in s}
    out: dict[str, float] = {}
    for key in sorted(keys):
        values = [float(v) for s in samples if _is_number(v := s.get(key))]
        finite = [v for v in values if math.isfinite(v)]
        if key == M.ERROR_RATE_PERCENT and len(values) < len(samples):
            continue
        if key in HIGHER_IS_WORSE:
            if values:
                out[key] = max(values)  # +inf stays: beyond the last bucket
        elif not finite:
            continue
        elif key in LOWER_IS_WORSE:
            out[key] = min(finite)
        else:
            out[key] = statistics.fmean(finite)
    return out


def slo_margin(metrics: Mapping[str, float], slo: SloTargets) -> float:
    """Worst relative margin under the headroom-adjusted limits; negative when a limit is exceeded.

    -inf when a latency target is not measured (nothing is known to pass).
    """
    margins = []
    for metric, target in slo.latency_targets().items():
        value = metrics.get(metric)
        if not _is_number(value) or math.isnan(value):
            return -math.inf
        limit = slo.limit(target)
        margins.append((limit - value) / limit)
    return min(margins) if margins else -math.inf


def close_step(load: int, runs: Sequence[RunResult], config: ProtocolConfig, full: bool = True) -> StepResult:
    """Combine the runs of a load step (worst case) and judge it against the SLO; `full`: run for the full window."""
    if not runs:
        raise ValueError(f"a step at load {load} has no run to close")
    combined = worst_case([r.metrics for r in runs])
    verdict = evaluate_slo(combined, config.slo)
    notes = [r.cross_check for r in runs if r.cross_check]
    return StepResult(load, {k: _round(v) for k, v in combined.items()}, verdict.verdict, verdict.reason[:500],
                      _round(slo_margin(combined, config.slo)), notes[0][:500] if notes else None, full)


def bracket_seconds(measure_seconds: int, requested: int | None = None, least: float = 0.0) -> int | None:
    """The window of a bracketing step, or None when steps should not be short.

    `requested`: spec.trial.bracketSeconds (0: off; None: a quarter of the window, at least
    MIN_BRACKET_SECONDS and `least`, the shortest window the metrics source measures well; off when that
    leaves it over half the full window, too little saved to pay for a confirmation). A window no shorter
    than the full one is no bracketing.
    """
    if requested == 0:
        return None
    if requested is not None:
        return requested if requested < measure_seconds else None
    seconds = max(math.ceil(measure_seconds * BRACKET_FRACTION), MIN_BRACKET_SECONDS, math.ceil(least))
    return seconds if seconds <= measure_seconds / 2 else None


def longer_run(metrics: Mapping[str, float], seconds: int, base_seconds: int, slo: SloTargets) -> int | None:
    """The window to run this load again for, when `seconds` gave too few requests to judge; else None.

    A slow setting at a low load finishes fewer requests than a percentile needs (`slo.min_samples`):
    that is no verdict, and no reason to give up on the setting, so the run is repeated for long enough
    to collect them (from the rate seen, with a quarter to spare), at most `MAX_LENGTHENING` times the
    configured window. A run that already breaks a limit is not lengthened: more requests cannot save it.
    """
    samples = metrics.get(M.SAMPLES)
    if not _is_number(samples) or not math.isfinite(samples) or samples >= slo.min_samples:
        return None
    if evaluate_slo(metrics, slo).verdict is not Verdict.UNKNOWN:
        return None
    ceiling = base_seconds * MAX_LENGTHENING
    if seconds >= ceiling:
        return None
    wanted = seconds * MAX_LENGTHENING if samples <= 0 else math.ceil(seconds * slo.min_samples * 1.25 / samples)
    return min(ceiling, wanted)  # always longer: fewer than min_samples means a ratio above 1.25


# ---- the next step ---------------------------------------------------------------------------


def capacity_start(setting: Setting, neighbours: Sequence[Neighbour], config: ProtocolConfig,
                   predicted: int | None = None) -> int:
    """Warm start: the capacity a twin predicted for this setting, else the nearest finished trial's capacity
    load, scaled to this trial's max-num-seqs."""
    seqs = setting.max_num_seqs
    if predicted is not None and predicted >= 1:
        return predicted
    if neighbours:
        nearest = min(neighbours, key=lambda n: (abs(math.log2(n.setting.max_num_seqs / seqs)),
                                                  n.setting.max_num_seqs))
        scale = 1.0 if config.open_loop else min(seqs / nearest.setting.max_num_seqs, 2.0)
        return max(1, int(nearest.capacity_load * max(scale, 0.5)))
    if config.first_load is not None:
        return config.first_load
    if config.open_loop:
        raise ValueError("an open-loop capacity search needs first_load (requests per minute)")
    return max(1, seqs // 2)


def capacity_ceiling(setting: Setting, config: ProtocolConfig) -> int:
    # Closed-loop users past max-num-seqs only queue: twice the batch is enough to see it fail.
    return OPEN_LOOP_CEILING if config.open_loop else max(2, setting.max_num_seqs * 2)


def next_load(steps: Sequence[StepResult], setting: Setting, neighbours: Sequence[Neighbour],
              config: ProtocolConfig, predicted: int | None = None) -> int | None:
    """The load of the trial's next search step, or None when the trial is measured enough to conclude."""
    step = next_search_step(steps, setting, neighbours, config, predicted)
    return None if step is None else step.load


def next_search_step(steps: Sequence[StepResult], setting: Setting, neighbours: Sequence[Neighbour],
                     config: ProtocolConfig, predicted: int | None = None) -> NextStep | None:
    """The trial's next search step (short while bracketing), or None when it is measured enough to conclude.

    `predicted`: a twin's predicted capacity for this setting, where the search starts. With bracketing the
    search runs on the settled steps (a full step replaces the short ones at its load); once it has settled,
    a capacity that only a short step passed at is measured again for the full window (at most
    MAX_CONFIRMATIONS times a trial)."""
    if not config.searches_capacity:
        if steps:
            return None
        return NextStep(config.fixed_load if config.fixed_load is not None else setting.max_num_seqs)
    misled = short_window_misled(steps)
    # A failed re-measurement moves the capacity below a pass the search counted on: room to find it.
    bounds = SearchBounds(start=capacity_start(setting, neighbours, config, predicted),
                          highest=capacity_ceiling(setting, config),
                          max_steps=config.max_steps + (EXTRA_STEPS_WHEN_MISLED if misled else 0),
                          resolution=config.resolution, min_samples=config.slo.min_samples)
    settled = settled_steps(steps)
    load = search_next(settled, bounds)
    if load is not None:
        return NextStep(load, short=config.bracketing and not misled)
    best = max((s for s in settled if s.passed), key=lambda s: s.load, default=None)
    if best is None or best.full or confirmations(steps) >= MAX_CONFIRMATIONS:
        return None
    return NextStep(best.load)


def settled_steps(steps: Sequence[StepResult]) -> list[StepResult]:
    """The steps the search decides on: a full-window step at a load replaces the short ones there."""
    full_loads = {s.load for s in steps if s.full}
    return [s for s in steps if s.full or s.load not in full_loads]


def confirmations(steps: Sequence[StepResult]) -> int:
    """Full-window steps at a load a short step ran at: re-measurements of a bracketing pass."""
    short_loads = {s.load for s in steps if not s.full}
    return sum(1 for s in steps if s.full and s.load in short_loads)


def short_window_misled(steps: Sequence[StepResult]) -> bool:
    """A full window failed a load a short one passed: short windows read this setting too kindly."""
    short_passes = {s.load for s in steps if not s.full and s.passed}
    return any(s.full and not s.passed and s.load in short_passes for s in steps)


def too_few_requests(step: StepResult, min_samples: int = MIN_SAMPLES) -> bool:
    """Whether a step is Unknown because too few requests finished to judge it: no verdict, not a failure.

    A closed loop at a low load finishes fewer requests in its window than a percentile needs, even after
    `longer_run`'s lengthening; a higher load finishes more."""
    samples = step.metrics.get(M.SAMPLES)
    return step.verdict is Verdict.UNKNOWN and _is_number(samples) and samples < min_samples


def search_next(steps: Sequence[StepResult], bounds: SearchBounds) -> int | None:
    """The SLO-capacity search: the next load to try, or None when the capacity is known well enough.

    A step with too few requests to judge (`too_few_requests`) is no verdict: alone (no fail above it, nor a
    pass) the load doubles for the next step; below a fail it is a floor (the next load lies between them);
    below a pass it says nothing."""
    if len(steps) >= bounds.max_steps:
        return None
    tried = {s.load for s in steps}
    judged = [s for s in steps if not too_few_requests(s, bounds.min_samples)]
    if len(judged) < len(steps):
        floor = max(s.load for s in steps if too_few_requests(s, bounds.min_samples))
        if not any(s.passed and s.load > floor for s in judged):
            return _above_unjudged(floor, judged, bounds)
        steps = judged  # below a pass, a step too thin to judge says nothing
    passes = [s for s in steps if s.passed]
    fails = [s for s in steps if not s.passed]
    if not steps:
        return _clamp(bounds.start, bounds)
    if not fails:
        best = max(passes, key=lambda s: s.load)
        if best.load >= bounds.highest or best.margin <= bounds.resolution:
            return None
        # Extrapolate the margin to zero, growing at least 1.25x (and by one) and at most 4x per step.
        return _clamp(max(best.load + 1, _extrapolate(best, low=1.25, high=4.0)), bounds)
    if not passes:
        worst = min(fails, key=lambda s: s.load)
        if worst.load <= bounds.lowest:
            return None
        return _clamp(_extrapolate(worst, low=0.25, high=0.8), bounds)  # below every load tried
    low = max(passes, key=lambda s: s.load)
    if low.margin <= bounds.resolution and any(s.load > low.load for s in fails):
        return None  # the highest pass already sits within the resolution of the SLO
    high = min((s for s in fails if s.load > low.load), key=lambda s: s.load, default=None)
    if high is None:
        # A fail below a pass: noise. Trust the highest pass and probe just above it.
        candidate = _clamp(int(low.load * (1 + bounds.resolution)) + 1, bounds)
        return None if candidate in tried else candidate
    if high.load - low.load <= max(1, math.ceil(low.load * bounds.resolution)):
        return None
    # No load strictly between the highest pass and the lowest fail above it was tried, and they are
    # at least 2 apart: the interpolation, or else the midpoint, is a new load between them.
    candidate = _interpolate(low, high)
    return candidate if low.load < candidate < high.load else (low.load + high.load) // 2


def _above_unjudged(floor: int, judged: Sequence[StepResult], bounds: SearchBounds) -> int | None:
    """The next load above `floor`, the highest load too thin to judge, with no pass above it: alone, twice the
    load; below a fail, between the two."""
    above = [s.load for s in judged if not s.passed and s.load > floor]
    if not above:
        return None if floor >= bounds.highest else _clamp(floor * 2, bounds)
    high = min(above)
    return None if high - floor <= max(1, math.ceil(floor * bounds.resolution)) else (floor + high) // 2


def _margin(step: StepResult) -> float:
    # An unmeasured step reads as far below the limit, so the search steps down from it.
    return step.margin if math.isfinite(step.margin) else -1e9


def _extrapolate(step: StepResult, low: float, high: float) -> int:
    # Margin ~ 1 - load / capacity near the boundary, so capacity ~ load / (1 - margin).
    margin = _margin(step)
    factor = 1.0 / (1.0 - margin) if margin < 1 else high
    return max(1, int(step.load * min(high, max(low, factor))))


FAR_PAST_THE_LIMIT = -1.0
"""A fail whose latency is over twice its limit: queueing past the capacity, whose margin says little of where."""


def _interpolate(low: StepResult, high: StepResult) -> int:
    # Linear root of the margin between the bracketing loads; margins shrink as load grows. A fail
    # whose margin is no lower (it failed on errors or samples) says nothing: low.load, the caller bisects.
    # Past the capacity latency explodes: a fail far past its limit would pin the root next to the pass
    # (the search then creeps up a little per step), so the bracket is halved geometrically at least.
    span = _margin(low) - _margin(high)
    if span <= 0:
        return low.load
    linear = int(low.load + _margin(low) / span * (high.load - low.load))
    if _margin(high) < FAR_PAST_THE_LIMIT:
        return max(linear, int(math.sqrt(low.load * high.load)))
    return linear


def _clamp(load: int, bounds: SearchBounds) -> int:
    return max(bounds.lowest, min(bounds.highest, load))


# ---- the common curve load ------------------------------------------------------------------


@dataclass(frozen=True)
class CurveLoad:
    """The one offered load every trial is also measured at, for the report's curves (never its verdict)."""

    load: int
    open_loop: bool
    """Open loop: `load` is requests per minute; closed: concurrent requests."""
    source: str = ""
    """Where the load came from, in words."""

    def __post_init__(self) -> None:
        if self.load < 1:
            raise ValueError(f"a curve load of {self.load!r} must be >= 1")

    @property
    def unit(self) -> str:
        return "requests/min" if self.open_loop else "concurrent requests"

    def label(self) -> str:
        return f"{self.load} {self.unit}"


def production_peak_curve_load(peak_requests_per_second: float | None, ready_replicas: int, largest_seqs: int,
                               measure_seconds: int | None) -> CurveLoad:
    """Production's peak per replica as an open loop, or, when that is unknown or too quiet to give a
    percentile in one measure window, a closed loop at the largest max-num-seqs planned (every trial
    then runs its whole batch: the batching curve itself)."""
    fallback = f"the largest maxNumSeqs planned ({largest_seqs}) as a closed loop"
    if peak_requests_per_second is None or not math.isfinite(peak_requests_per_second) \
            or peak_requests_per_second <= 0:
        return CurveLoad(largest_seqs, False, f"{fallback}: production's peak request rate is unknown "
                                              "(Prometheus has no request rate for production over the last hour)")
    replicas = max(1, ready_replicas)
    per_minute = max(1, math.ceil(peak_requests_per_second * 60 / replicas))
    peak = (f"production's peak 1-minute rate over the last hour, {peak_requests_per_second:.3g} req/s over "
            f"{replicas} ready replica{'s' if replicas != 1 else ''}")
    if measure_seconds is not None and per_minute * measure_seconds / 60 < MIN_SAMPLES:
        return CurveLoad(largest_seqs, False, f"{fallback}: {peak} ({per_minute}/min per replica) gives fewer "
                                              f"than {MIN_SAMPLES} requests in a {measure_seconds}s window")
    return CurveLoad(per_minute, True, peak + " (per replica)")


def search_step_at(steps: Sequence[StepResult], curve: CurveLoad, config: ProtocolConfig) -> int | None:
    """Index of a search step that already ran at the curve load (same kind of loop): no extra run needed."""
    if curve.open_loop != config.open_loop:
        return None
    return next((i for i, s in enumerate(steps) if s.load == curve.load), None)


def runs_needed(curve: bool, config: ProtocolConfig) -> int:
    """Runs a step takes: `repeats` for the search's; one for the curve step (it decides nothing)."""
    return 1 if curve else config.repeats


@dataclass(frozen=True)
class NextStep:
    load: int
    curve: bool = False
    """The extra step at the common curve load (outside the search)."""
    short: bool = False
    """A bracketing step of the search: run for the short window (`bracket_seconds`)."""


def next_step(steps: Sequence[StepResult], setting: Setting, neighbours: Sequence[Neighbour],
              config: ProtocolConfig, curve: CurveLoad | None, curve_done: bool,
              predicted: int | None = None) -> NextStep | None:
    """The trial's next step: the search's, then (once the search is done) the curve step unless the curve
    load was one of the search's own loads or `curve_done` (measured, or given up); None: conclude.
    `steps` are the search's closed steps only; `predicted` as for `next_load`."""
    step = next_search_step(steps, setting, neighbours, config, predicted)
    if step is not None:
        return step
    if curve is None or curve_done or search_step_at(steps, curve, config) is not None:
        return None
    return NextStep(curve.load, curve=True)


# ---- the outcome -----------------------------------------------------------------------------


def conclude(steps: Sequence[StepResult], config: ProtocolConfig) -> Conclusion:
    """The trial's metrics and verdict from its closed steps."""
    conclusion = _conclude(steps, config)
    observed = tuple(StepObservation(s.load, s.metrics, s.verdict,
                                     s.margin if s.margin is not None and math.isfinite(s.margin) else None)
                     for s in steps)
    return Conclusion(conclusion.metrics, conclusion.verdict, conclusion.verdict_reason, conclusion.reason,
                      conclusion.message, conclusion.steps, observed)


def _conclude(steps: Sequence[StepResult], config: ProtocolConfig) -> Conclusion:
    if not steps:
        return Conclusion({}, Verdict.UNKNOWN, "no load step was measured", Reason.NOT_MEASURED,
                          "no load step was measured")
    if not config.searches_capacity:
        step = steps[-1]
        if step.passed:
            message = step.cross_check or f"measured at load {step.load}"
        else:  # what a rejection quotes: why the step failed first, a cross-check note after it
            message = step.verdict_reason + (f"; {step.cross_check}" if step.cross_check else "")
        return Conclusion(_figures(step, steps), step.verdict, step.verdict_reason, Reason.MEASURED, message,
                          len(steps))
    passing = [s for s in steps if s.passed and s.full]  # a short window alone never makes a capacity
    if not passing and all(too_few_requests(s, config.slo.min_samples) for s in steps):
        step = max(steps, key=lambda s: s.load)
        why = (f"too few requests to judge even at the highest load tried ({step.load} {config.unit}): "
               f"{step.verdict_reason}")
        return Conclusion(_figures(step, steps), Verdict.UNKNOWN, why, Reason.NO_CAPACITY,
                          why + (f"; {step.cross_check}" if step.cross_check else ""), len(steps))
    if not passing:
        unconfirmed = any(s.passed for s in steps)
        judged = [s for s in steps if not s.passed] if unconfirmed else steps
        # A step too thin to judge failed nothing: the lowest load that did fail speaks for the trial.
        judged = [s for s in judged if not too_few_requests(s, config.slo.min_samples)] or judged
        step = min(judged, key=lambda s: s.load)
        verdict = Verdict.UNKNOWN if all(s.verdict is Verdict.UNKNOWN for s in judged) else Verdict.VIOLATED
        why = (f"no load passed for the full window, only short bracketing ones; the lowest that fails "
               f"({step.load}): {step.verdict_reason}" if unconfirmed else
               f"even the lowest load ({step.load}) fails: {step.verdict_reason}")
        # The message is what a rejection quotes: the failure first, a cross-check note after it.
        return Conclusion(_figures(step, steps), verdict, why, Reason.NO_CAPACITY,
                          why + (f"; {step.cross_check}" if step.cross_check else ""), len(steps))
    best = max(passing, key=lambda s: s.load)
    metrics = _figures(best, steps)
    capacity = offered_rate(best.load, config) or metrics.get(M.REQUEST_THROUGHPUT)
    if capacity is not None:
        metrics[M.SLO_CAPACITY] = capacity
    metrics[M.SLO_CAPACITY_LOAD] = float(best.load)
    rate = "unmeasured" if capacity is None else f"{capacity:.3g} req/s"
    return Conclusion(metrics, Verdict.MET, f"SLO capacity {rate} at {best.load} {config.unit}: {best.verdict_reason}",
                      Reason.MEASURED, best.cross_check or f"{len(steps)} load steps", len(steps))


def offered_rate(load: int, config: ProtocolConfig) -> float | None:
    """An open loop's offered rate in requests per second; None for a closed loop or a trace's speed.

    A step that met the SLO in a steady state (its queue did not grow) served what it was offered, so that
    rate is its capacity: the requests a finite window saw finish are a noisy count when requests are long.
    """
    return _round(load / 60) if config.open_loop and not config.trace else None


def _figures(step: StepResult, steps: Sequence[StepResult]) -> dict[str, float]:
    """The deciding step's metrics, the peaks over every step, and the derived figures."""
    metrics = dict(step.metrics)
    for peak, names in PEAKS.items():
        values = [float(v) for s in steps for name in names
                  if _is_number(v := s.metrics.get(name)) and math.isfinite(v)]
        if values:
            metrics[peak] = max(values)
    throughput, watts = metrics.get(M.OUTPUT_THROUGHPUT), metrics.get(M.POWER_WATTS)
    if _is_number(throughput) and _is_number(watts) and math.isfinite(watts) and watts > 0:
        metrics[M.TOKENS_PER_JOULE] = round(throughput / watts, 4)  # watts of all the pod's GPUs
    return metrics


def neighbours_of(trials: Sequence[tuple[Setting, Mapping[str, float]]]) -> list[Neighbour]:
    """The finished trials with a measured capacity load."""
    out = []
    for setting, metrics in trials:
        load = metrics.get(M.SLO_CAPACITY_LOAD)
        if _is_number(load) and math.isfinite(load) and load >= 1:
            out.append(Neighbour(setting, int(load)))
    return out


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _round(value: float) -> float:
    return round(value, 4)  # inf and NaN round to themselves


@dataclass
class TrialDriver:
    """A trial run to its end in one go, for callers that measure synchronously (the bench)."""

    setting: Setting
    config: ProtocolConfig
    neighbours: Sequence[Neighbour] = ()
    steps: list[StepResult] = field(default_factory=list)
    predicted: int | None = None
    """A twin's predicted capacity load, where the search starts."""

    def next_load(self) -> int | None:
        return next_load(self.steps, self.setting, self.neighbours, self.config, self.predicted)

    def next_step(self) -> NextStep | None:
        return next_search_step(self.steps, self.setting, self.neighbours, self.config, self.predicted)

    def record(self, load: int, runs: Sequence[RunResult], full: bool = True) -> StepResult:
        step = close_step(load, runs, self.config, full)
        self.steps.append(step)
        return step

    def conclude(self) -> Conclusion:
        return conclude(self.steps, self.config)
