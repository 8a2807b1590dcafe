"""SLO evaluation: a step or trial meets its SLO only on enough finite measured numbers under every target.

Headroom: a latency target T with headroom H% passes when value <= T * (100 - H) / 100, so "Met"
already includes the margin kept for traffic peaks. Missing data and NaN are Unknown, never Met; a
latency of +inf (a quantile above the histogram's last finite bucket) is a violation. Where the
evidence says how many requests a percentile rests on, fewer than `min_samples` is Unknown; where it
says the queue grew through the window, the load was not steady and cannot pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchtune.core.vocabulary import M, Verdict

METRIC_TTFT_MS = M.TTFT_MS
METRIC_ITL_MS = M.ITL_MS
METRIC_E2E_MS = M.E2E_MS
METRIC_ERROR_RATE_PERCENT = M.ERROR_RATE_PERCENT

MIN_SAMPLES = 20
"""Fewer requests than this behind a step's percentiles and the step is Unknown."""
QUEUE_GROWTH_REQUESTS = 2.0
"""A queue that grows by more than this (and by more than half its mean) through the window is no steady state."""

PERCENTILES = {"P50": 50, "P90": 90, "P95": 95, "P99": 99}


@dataclass(frozen=True)
class SloTargets:
    percentile: int = 95
    """Which percentile the latency metrics are taken at (50, 90, 95 or 99)."""
    ttft_ms: int | None = None
    itl_ms: int | None = None
    e2e_ms: int | None = None
    max_error_rate_percent: float = 1.0
    headroom_percent: int = 10
    """Margin below each latency target (and below the knee in selection)."""
    min_samples: int = MIN_SAMPLES

    def __post_init__(self) -> None:
        if self.percentile not in PERCENTILES.values():
            raise ValueError(f"percentile {self.percentile!r} is not one of 50, 90, 95, 99")
        if not 0 <= self.headroom_percent < 100:
            raise ValueError(f"headroom_percent {self.headroom_percent!r} is outside 0..99")
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} {value!r} must be > 0")

    def latency_targets(self) -> dict[str, int]:
        """Status metric name -> target in ms, for the targets that are set."""
        pairs = ((METRIC_TTFT_MS, self.ttft_ms), (METRIC_ITL_MS, self.itl_ms), (METRIC_E2E_MS, self.e2e_ms))
        return {metric: target for metric, target in pairs if target is not None}

    def limit(self, target_ms: float) -> float:
        """The value a measurement must not exceed: the target less the headroom."""
        return target_ms * (100 - self.headroom_percent) / 100


@dataclass(frozen=True)
class SloVerdict:
    verdict: Verdict
    reasons: tuple[str, ...]
    """One line per target: why it passed, failed or is unknown."""

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


_LABELS: dict[str, str] = {METRIC_TTFT_MS: "TTFT", METRIC_ITL_MS: "ITL", METRIC_E2E_MS: "E2E latency"}


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _latency(value: Any) -> float | None:
    """A latency, where +inf (beyond the last bucket) stays +inf and NaN or junk is None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == math.inf:
        return math.inf
    return _finite(value)


def not_steady(metrics: Mapping[str, Any]) -> str | None:
    """Why the load was not a steady state (the queue grew through the window), or None."""
    growth = _finite(metrics.get(M.WAITING_GROWTH))
    if growth is None:
        return None
    mean = _finite(metrics.get(M.WAITING_REQUESTS)) or 0.0
    if growth > max(QUEUE_GROWTH_REQUESTS, 0.5 * mean):
        return (f"the queue grew by {_fmt(growth)} requests through the window (mean {_fmt(mean)} waiting): "
                "the load exceeds what the setting serves, so no latency measured here holds")
    return None


def _fmt(value: float) -> str:
    return f"{value:.1f}".removesuffix(".0")


def evaluate_slo(metrics: Mapping[str, Any], slo: SloTargets) -> SloVerdict:
    """Met when every set latency target and the error rate are measured and within limits.

    Violated wins over Unknown (one measured breach is enough to reject); Unknown wins over Met.
    """
    violated: list[str] = []
    unknown: list[str] = []
    met: list[str] = []
    targets = slo.latency_targets()
    if not targets:
        unknown.append("no latency target is set, so the SLO cannot be met")
    p = f"p{slo.percentile}"
    for metric, target in targets.items():
        label = f"{p} {_LABELS[metric]}"
        value = _latency(metrics.get(metric))
        if value is None or value < 0:
            unknown.append(f"{label} is not measured ({metric}={metrics.get(metric)!r})")
            continue
        limit = slo.limit(target)
        margin = f"{target} ms target less {slo.headroom_percent}% headroom" if slo.headroom_percent else f"{target} ms target"
        if value == math.inf:
            violated.append(f"{label} is above the highest histogram bucket (> every finite bound; {margin})")
        elif value <= limit:
            met.append(f"{label} {_fmt(value)} ms <= {_fmt(limit)} ms ({margin})")
        else:
            violated.append(f"{label} {_fmt(value)} ms > {_fmt(limit)} ms ({margin})")
    error_rate = _finite(metrics.get(METRIC_ERROR_RATE_PERCENT))
    if error_rate is None or error_rate < 0:
        unknown.append(f"error rate is not measured ({METRIC_ERROR_RATE_PERCENT}={metrics.get(METRIC_ERROR_RATE_PERCENT)!r})")
    elif error_rate > slo.max_error_rate_percent:
        violated.append(f"error rate {_fmt(error_rate)}% > {_fmt(slo.max_error_rate_percent)}%")
    else:
        met.append(f"error rate {_fmt(error_rate)}% <= {_fmt(slo.max_error_rate_percent)}%")
    unsteady = not_steady(metrics)
    if unsteady:
        violated.append(unsteady)
    samples = _finite(metrics.get(M.SAMPLES))
    if samples is not None and samples < slo.min_samples:
        unknown.append(f"only {int(samples)} requests behind the percentiles (at least {slo.min_samples} needed)")
    if violated:
        return SloVerdict(Verdict.VIOLATED, tuple(violated + unknown))
    if unknown:
        return SloVerdict(Verdict.UNKNOWN, tuple(unknown))
    return SloVerdict(Verdict.MET, tuple(met))
