"""One load run's figures from its two witnesses: the engine's metrics (Prometheus) and the load generator.

Prometheus gives rates, queue, KV and GPU signals over the run's measurement window. The engine's
latency histograms are coarse (vLLM's ITL buckets 10, 25, 50, 75 ms; e2e from 300 ms), so an
interpolated p95 can sit tens of percent off: the load generator's exact client-side percentiles
decide the SLO when it reported them (with the requests still in flight at the window's end counted
at their elapsed time, so an overloaded run cannot look fast), and the histogram values stay beside
them for the record. Where the two disagree by more than `CROSS_CHECK_TOLERANCE` the run says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from batchtune.core.protocol import RunResult
from batchtune.core.vocabulary import M

CROSS_CHECK_TOLERANCE = 0.25
# The figures a run needs before any decision: throughput; latencies at the SLO percentile come on top.
REQUIRED = (M.REQUEST_THROUGHPUT, M.OUTPUT_THROUGHPUT)
# Status metric <- load-generator summary key stem (vllm bench serve's names).
CLIENT_LATENCIES = ((M.ITL_MS, M.ITL_HISTOGRAM_MS, "itl"), (M.TTFT_MS, M.TTFT_HISTOGRAM_MS, "ttft"),
                    (M.E2E_MS, M.E2E_HISTOGRAM_MS, "e2el"))


@dataclass(frozen=True)
class Window:
    """When a run measured: from the end of its warm-up to when its load stopped."""

    start: datetime
    end: datetime

    @property
    def seconds(self) -> int:
        return max(1, int((self.end - self.start).total_seconds()))


def measurement_window(summary: Mapping[str, Any] | None, job_started: datetime | None,
                       job_finished: datetime | None, warmup_seconds: int) -> Window | None:
    """The load generator's own window when it reported one, else the Job's times less the warm-up.

    The Job starts before its pod pulls, starts and warms up; its completion comes after the load
    stopped. Only what the generator says it measured is the window; the Job times are a fallback
    for generators that do not say (then the warm-up is cut from the start).
    """
    if summary:
        start, end = _epoch(summary.get("measure_start")), _epoch(summary.get("measure_end"))
        if start is not None and end is not None and end > start:
            return Window(start, end)
    if job_started is None or job_finished is None:
        return None
    start = job_started + timedelta(seconds=warmup_seconds)
    return Window(start, job_finished) if job_finished > start else None


def _epoch(value: Any) -> datetime | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return datetime.fromtimestamp(float(value), tz=UTC)
    return None


MIN_SCRAPES_PER_WINDOW = 2
"""rate() over a window needs at least two samples in it: a shorter window reads as no data."""


def window_too_short(seconds: float, scrape_interval_s: float, knob: str = "spec.trial.measureSeconds") -> str | None:
    """Why Prometheus cannot measure a window of `seconds`, or None; `knob` is the field that lengthens it."""
    least = MIN_SCRAPES_PER_WINDOW * scrape_interval_s
    if seconds >= least:
        return None
    return (f"the measurement window is {seconds:.3g}s, shorter than {MIN_SCRAPES_PER_WINDOW} Prometheus scrape "
            f"intervals ({least:g}s at {scrape_interval_s:g}s, the install's prometheus.scrapeIntervalSeconds): "
            f"rates over it read as no data; raise {knob}")


def missing(values: Mapping[str, float | None], latency_metrics: tuple[str, ...]) -> list[str]:
    """The figures a decision needs that the run lacks (latencies the load generator may still give)."""
    return [name for name in REQUIRED if values.get(name) is None] + \
        [name for name in latency_metrics if values.get(name) is None]


def run_result(prometheus: Mapping[str, float | None], summary: Mapping[str, Any] | None,
               percentile: int) -> RunResult:
    """One load run's metrics: Prometheus for rates and engine/GPU signals, client-side latency percentiles."""
    values: dict[str, float] = {k: float(v) for k, v in prometheus.items() if v is not None}
    if not summary:
        return RunResult(values, None)
    _add_client_figures(values, summary, percentile)
    return RunResult(values, "; ".join(_disagreements(values, summary, percentile)) or None)


def _add_client_figures(values: dict[str, float], summary: Mapping[str, Any], percentile: int) -> None:
    """The load generator's counts, exact means and percentiles into `values` (Prometheus' histogram latencies kept
    beside them)."""
    completed, failed = _count(summary.get("completed")), _count(summary.get("failed"))
    if completed is not None and failed is not None and completed + failed > 0:
        values[M.ERROR_RATE_PERCENT] = 100.0 * failed / (completed + failed)
    for key, metric in (("samples", M.SAMPLES), ("in_flight", M.IN_FLIGHT),
                        ("offered_request_rate", M.OFFERED_REQUEST_RATE), ("request_goodput", M.GOODPUT)):
        number = _number(summary.get(key))
        if number is not None:
            values[metric] = number
    for ours, stem in ((M.TTFT_MEAN_MS, "ttft"), (M.ITL_MEAN_MS, "itl")):
        client = _number(summary.get(f"mean_{stem}_ms"))
        if client is not None:
            values[ours] = client  # the load generator's exact mean, as for the percentiles
    for ours, histogram_key, stem in CLIENT_LATENCIES:
        client = _number(summary.get(f"p{percentile}_{stem}_ms"))
        if client is None:
            continue
        if ours in values:
            values[histogram_key] = values[ours]
        values[ours] = client


def _disagreements(values: Mapping[str, float], summary: Mapping[str, Any], percentile: int) -> list[str]:
    """Where Prometheus and the load generator are more than CROSS_CHECK_TOLERANCE apart."""
    notes = []
    pairs = ((M.REQUEST_THROUGHPUT, "request_throughput"), (M.OUTPUT_THROUGHPUT, "output_throughput"),
             (M.ITL_HISTOGRAM_MS, f"p{percentile}_itl_ms"), (M.TTFT_HISTOGRAM_MS, f"p{percentile}_ttft_ms"),
             (M.E2E_HISTOGRAM_MS, f"p{percentile}_e2el_ms"))
    for ours, theirs in pairs:
        a, b = values.get(ours), _number(summary.get(theirs))
        if a is not None and b is not None and math.isfinite(a) and max(a, b) > 0:
            gap = abs(a - b) / max(a, b)
            if gap > CROSS_CHECK_TOLERANCE:
                notes.append(f"{ours}: Prometheus {a:.4g} vs load generator {b:.4g} ({gap:.0%} apart)")
    return notes


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number >= 0 else None
