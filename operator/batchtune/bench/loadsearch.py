"""Searches on the offered load for the SLO capacity of one setting (the highest load meeting every SLO).

`exact_capacity` is the oracle's noise-free search: a saturation probe (or a neighbour's capacity as a
hint), then a bracketed search interpolating the SLO margin (as `vllm bench sweep serve_sla` does) down
to a fine tolerance. Tuning trials use the controller's own search instead (`evaluate.operator_trial`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

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
    hint: float | None = None,
) -> CapacityResult:
    """Noise-free capacity to `rel_tol` (rates) or to the unit (concurrency). With a `hint` (a
    neighbouring setting's capacity) the bracket is found by stepping 5% from it, which saves most steps."""
    if hint is not None and hint > 0:
        found = _capacity_from_hint(measure, slo, kind, hint, rel_tol, max_steps)
        if found is not None:
            return found
    return _capacity(measure, slo, kind, saturation_concurrency, rel_tol, max_steps)


def _capacity_from_hint(
    measure: MeasureFn, slo: Slo, kind: LoadKind, hint: float, rel_tol: float, max_steps: int
) -> CapacityResult | None:
    """None when the hint does not lead to a bracket within a few steps (the full search then runs)."""

    def at(value: float) -> float:
        return float(max(1, round(value))) if kind == "concurrency" else value

    growth = [1.05]

    def step(value: float, up: bool) -> float:
        # 5%, then widening steps: a neighbour's capacity can be far off.
        factor = growth[0]
        growth[0] = min(growth[0] ** 2, 2.0)
        nxt = at(value * (factor if up else 1 / factor))
        if kind == "concurrency" and nxt == value:
            nxt = value + 1 if up else max(1.0, value - 1)
        return nxt

    load = at(hint)
    reading = measure(Load(kind, load))
    steps = 1
    if not reading.ok:
        return None
    passing = _passes(slo, reading)
    lo: tuple[float, Reading] | None = (load, reading) if passing else None
    hi: tuple[float, Reading] | None = None if passing else (load, reading)
    while steps < 8 and (lo is None or hi is None):
        # The loop runs while exactly one end of the bracket is known: without lo there is a hi.
        base = lo[0] if lo is not None else cast("tuple[float, Reading]", hi)[0]
        probe = step(base, up=lo is not None)
        if probe < (1 if kind == "concurrency" else MIN_RATE) or (kind == "concurrency" and probe == base):
            return None
        reading = measure(Load(kind, probe))
        steps += 1
        if not reading.ok:
            return None
        if _passes(slo, reading):
            lo = (probe, reading)
        else:
            hi = (probe, reading)
    if lo is None or hi is None:
        return None
    found, steps = _search(measure, slo, kind, lo, hi, MIN_RATE, rel_tol, max_steps, steps)
    return _result(kind, found, steps, None)


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
