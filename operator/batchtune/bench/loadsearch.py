"""Searches on the offered load for the SLO capacity of one setting (the highest load meeting every SLO).

`exact_capacity` is the oracle's noise-free search; `measured_capacity` is what a tuning run can afford on
a live server: a saturation probe, then a bracketed search interpolating the SLO margin (as
`vllm bench sweep serve_sla` does), a handful of load steps in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from batchtune.bench.types import Load, LoadKind, Reading, Slo

MeasureFn = Callable[[Load], Reading]

# Open-loop rates below this are not worth serving; a setting that cannot hold it has no capacity.
MIN_RATE = 0.05


@dataclass(frozen=True)
class CapacityResult:
    """Highest passing load found (None: nothing passed) and the steps it took."""

    load: Load | None
    reading: Reading | None
    steps: int
    saturation: Reading | None = None

    @property
    def value(self) -> float:
        return 0.0 if self.load is None else self.load.value


def _passes(slo: Slo, reading: Reading) -> bool:
    return reading.ok and slo.met_by(reading.metrics)


def _next_load(kind: LoadKind, lo: float, hi: float, lo_margin: float, hi_margin: float) -> float:
    """Interpolate log(margin) against log(load) between a passing lo and a failing hi (regula falsi);
    fall back to the geometric midpoint when the margins give no usable slope."""
    mid = math.sqrt(lo * hi)
    if all(map(math.isfinite, (lo_margin, hi_margin))) and lo_margin > 0 and hi_margin > lo_margin:
        a, b = math.log(lo_margin), math.log(hi_margin)
        t = (0.0 - a) / (b - a)
        guess = math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))
        # Keep the guess off the bracket ends so each step shrinks the bracket.
        span = math.log(hi / lo)
        guess = min(max(guess, lo * math.exp(0.15 * span)), hi * math.exp(-0.15 * span))
        mid = guess
    if kind == "concurrency":
        mid = float(min(max(round(mid), lo + 1), hi - 1))
    return mid


def _search(
    measure: MeasureFn,
    slo: Slo,
    kind: LoadKind,
    lo: tuple[float, Reading] | None,
    hi: tuple[float, Reading],
    floor: float,
    rel_tol: float,
    max_steps: int,
    steps: int,
) -> tuple[tuple[float, Reading] | None, int]:
    """Shrink [lo, hi] (hi fails) until hi/lo - 1 <= rel_tol or the steps run out."""
    hi_load, hi_reading = hi
    if lo is None:
        # Find any passing load by stepping down geometrically from the failing one.
        probe = hi_load
        while steps < max_steps:
            probe = probe / 4.0
            if kind == "concurrency":
                probe = float(max(1, math.floor(probe)))
            if probe < floor:
                return None, steps
            reading = measure(Load(kind, probe))
            steps += 1
            if _passes(slo, reading):
                lo = (probe, reading)
                break
            hi_load, hi_reading = probe, reading
            if kind == "concurrency" and probe <= 1:
                return None, steps
        if lo is None:
            return None, steps
    lo_load, lo_reading = lo
    while steps < max_steps:
        if kind == "concurrency" and hi_load - lo_load <= 1:
            break
        if kind == "request_rate" and hi_load / lo_load - 1 <= rel_tol:
            break
        guess = _next_load(kind, lo_load, hi_load, slo.margin(lo_reading.metrics), slo.margin(hi_reading.metrics))
        reading = measure(Load(kind, guess))
        steps += 1
        if _passes(slo, reading):
            lo_load, lo_reading = guess, reading
        else:
            hi_load, hi_reading = guess, reading
    return (lo_load, lo_reading), steps


def exact_capacity(
    measure: MeasureFn,
    slo: Slo,
    kind: LoadKind,
    *,
    saturation_concurrency: int,
    rel_tol: float = 0.005,
    max_steps: int = 40,
) -> CapacityResult:
    """Noise-free capacity to `rel_tol` (rates) or to the unit (concurrency)."""
    return _capacity(measure, slo, kind, saturation_concurrency, rel_tol, max_steps)


def measured_capacity(
    measure: MeasureFn,
    slo: Slo,
    kind: LoadKind,
    *,
    saturation_concurrency: int,
    rel_tol: float = 0.02,
    max_steps: int = 6,
) -> CapacityResult:
    """What a tuning trial measures: at most `max_steps` load steps, the saturation probe included."""
    return _capacity(measure, slo, kind, saturation_concurrency, rel_tol, max_steps)


def _capacity(
    measure: MeasureFn, slo: Slo, kind: LoadKind, saturation_concurrency: int, rel_tol: float, max_steps: int
) -> CapacityResult:
    # Saturation probe: a closed loop as deep as the batch gives the most the setting can serve.
    sat_conc = max(1, saturation_concurrency)
    saturation = measure(Load("concurrency", float(sat_conc)))
    steps = 1
    if not saturation.ok:
        return CapacityResult(None, None, steps, saturation)
    if kind == "concurrency":
        if _passes(slo, saturation):
            # Beyond a full batch requests queue; see how far the queue stays within the SLO.
            lo: tuple[float, Reading] = (float(sat_conc), saturation)
            probe = float(sat_conc)
            while steps < max_steps:
                probe *= 2
                reading = measure(Load(kind, probe))
                steps += 1
                if not _passes(slo, reading):
                    found, steps = _search(measure, slo, kind, lo, (probe, reading), 1.0, rel_tol, max_steps, steps)
                    return _result(kind, found, steps, saturation)
                lo = (probe, reading)
            return _result(kind, lo, steps, saturation)
        found, steps = _search(measure, slo, kind, None, (float(sat_conc), saturation), 1.0, rel_tol, max_steps, steps)
        return _result(kind, found, steps, saturation)
    # Open loop: no rate above the saturated request throughput can be held for long.
    rps = saturation.get("request_throughput", 0.0)
    if not rps > 0 or math.isnan(rps):
        return CapacityResult(None, None, steps, saturation)
    hi_load = rps * 1.02
    hi_reading = measure(Load(kind, hi_load))
    steps += 1
    if _passes(slo, hi_reading):
        return CapacityResult(Load(kind, hi_load), hi_reading, steps, saturation)
    # Start the bracket search near where latency-bound settings usually pass.
    first = rps * 0.8
    first_reading = measure(Load(kind, first))
    steps += 1
    if _passes(slo, first_reading):
        found, steps = _search(
            measure, slo, kind, (first, first_reading), (hi_load, hi_reading), MIN_RATE, rel_tol, max_steps, steps
        )
    else:
        found, steps = _search(measure, slo, kind, None, (first, first_reading), MIN_RATE, rel_tol, max_steps, steps)
    return _result(kind, found, steps, saturation)


def _result(
    kind: LoadKind, found: tuple[float, Reading] | None, steps: int, saturation: Reading | None
) -> CapacityResult:
    if found is None:
        return CapacityResult(None, None, steps, saturation)
    return CapacityResult(Load(kind, found[0]), found[1], steps, saturation)
