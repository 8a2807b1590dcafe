"""SLO capacity of one trial: the highest load it sustains while meeting every SLO.

The search brackets (doubling up from a pass, halving down from a fail) and then interpolates
the SLO margin between the highest pass and the lowest fail, as vLLM's `serve_sla` sweep does,
instead of stepping linearly. Each step costs a load run, so the number of steps is bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LoadStep:
    load: int
    """Closed-loop concurrency, or open-loop requests per minute."""
    passed: bool
    margin: float
    """Worst relative SLO margin: (target - value) / target over all targets; >= 0 passes."""
    throughput: float
    """Request throughput measured at this load (requests per second)."""


@dataclass(frozen=True)
class SearchBounds:
    start: int
    lowest: int = 1
    highest: int = 1 << 20
    max_steps: int = 5
    resolution: float = 0.1
    """Stop when the gap between the highest pass and the lowest fail is within this fraction."""


def next_load(steps: Sequence[LoadStep], bounds: SearchBounds) -> int | None:
    """The next load to try, or None when the capacity is known well enough."""
    if len(steps) >= bounds.max_steps:
        return None
    tried = {s.load for s in steps}
    passes = [s for s in steps if s.passed]
    fails = [s for s in steps if not s.passed]
    if not steps:
        return _clamp(bounds.start, bounds)
    if not fails:
        best = max(passes, key=lambda s: s.load)
        if best.load >= bounds.highest or best.margin <= bounds.resolution:
            return None
        # Extrapolate the margin to zero, growing at least 1.25x and at most 4x per step.
        estimate = _extrapolate(best, low=1.25, high=4.0)
        candidate = _clamp(estimate, bounds)
        return None if candidate in tried else candidate
    if not passes:
        worst = min(fails, key=lambda s: s.load)
        if worst.load <= bounds.lowest:
            return None
        candidate = _clamp(_extrapolate(worst, low=0.25, high=0.8), bounds)
        return None if candidate in tried else candidate
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
    candidate = _interpolate(low, high)
    if candidate <= low.load or candidate >= high.load or candidate in tried:
        candidate = (low.load + high.load) // 2
    return None if candidate in tried or candidate <= low.load else candidate


def capacity(steps: Sequence[LoadStep]) -> LoadStep | None:
    """The highest passing step below every failing one (None when nothing passed)."""
    passes = [s for s in steps if s.passed]
    if not passes:
        return None
    return max(passes, key=lambda s: s.load)


def _extrapolate(step: LoadStep, low: float, high: float) -> int:
    # Margin ~ 1 - load / capacity near the boundary, so capacity ~ load / (1 - margin).
    factor = 1.0 / (1.0 - step.margin) if step.margin < 1 else high
    if not math.isfinite(factor):
        factor = high
    return max(1, int(step.load * min(high, max(low, factor))))


def _interpolate(low: LoadStep, high: LoadStep) -> int:
    # Linear root of the margin between the bracketing loads; margins shrink as load grows.
    span = low.margin - high.margin
    if span <= 0 or not math.isfinite(span):
        return (low.load + high.load) // 2
    fraction = low.margin / span
    return int(low.load + fraction * (high.load - low.load))


def _clamp(load: int, bounds: SearchBounds) -> int:
    return max(bounds.lowest, min(bounds.highest, load))
