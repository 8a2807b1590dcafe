"""The knee of the max-num-seqs curve: where throughput gains flatten while latency keeps rising."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from batchtune.core.vocabulary import M

KNEE_GAIN_PERCENT = 10.0
"""Below this throughput gain per doubling of max-num-seqs, a larger batch is not worth its latency."""

THROUGHPUT_METRICS = (M.OUTPUT_THROUGHPUT, M.REQUEST_THROUGHPUT)
LATENCY_METRICS = (M.E2E_MS, M.ITL_MS, M.TTFT_MS)


@dataclass(frozen=True)
class CurvePoint:
    max_num_seqs: int
    throughput: float
    latency_ms: float | None = None


@dataclass(frozen=True)
class Knee:
    max_num_seqs: int
    reason: str


def _finite(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def curve_point(max_num_seqs: int, metrics: Mapping[str, object]) -> CurvePoint | None:
    """A point from status metrics, or None without a positive throughput."""
    throughput = next((v for m in THROUGHPUT_METRICS if (v := _finite(metrics.get(m))) is not None), None)
    if throughput is None or throughput <= 0:
        return None
    latency = next((v for m in LATENCY_METRICS if (v := _finite(metrics.get(m))) is not None), None)
    return CurvePoint(max_num_seqs, throughput, latency)


def mean_point(points: Sequence[CurvePoint]) -> CurvePoint:
    """One point from the repeats at one max-num-seqs: the mean throughput, the mean of the known latencies."""
    latencies = [p.latency_ms for p in points if p.latency_ms is not None]
    return CurvePoint(points[0].max_num_seqs, sum(p.throughput for p in points) / len(points),
                      sum(latencies) / len(latencies) if latencies else None)


def gain_per_doubling(a: CurvePoint, b: CurvePoint) -> float:
    """Relative throughput gain per doubling of max-num-seqs between two points, in percent."""
    doublings = math.log2(b.max_num_seqs / a.max_num_seqs)
    return float(((b.throughput / a.throughput) ** (1 / doublings) - 1) * 100)


def find_knee(points: Sequence[CurvePoint], threshold_percent: float = KNEE_GAIN_PERCENT) -> Knee | None:
    """The first max-num-seqs past which the gain per doubling falls below the threshold while
    latency rises (latency unknown on either side: the gain alone decides)."""
    ordered = sorted({p.max_num_seqs: p for p in points}.values(), key=lambda p: p.max_num_seqs)
    for a, b in pairwise(ordered):
        gain = gain_per_doubling(a, b)
        if gain >= threshold_percent:
            continue
        if a.latency_ms is not None and b.latency_ms is not None and b.latency_ms <= a.latency_ms:
            continue
        latency = (
            f", latency {a.latency_ms:.0f} -> {b.latency_ms:.0f} ms"
            if a.latency_ms is not None and b.latency_ms is not None else ""
        )
        return Knee(
            a.max_num_seqs,
            f"throughput gains {gain:.1f}% per doubling from max-num-seqs {a.max_num_seqs} to "
            f"{b.max_num_seqs} ({a.throughput:.0f} -> {b.throughput:.0f}){latency}, below {threshold_percent:g}%",
        )
    return None
