"""Turn per-request records into a `vllm bench serve`-compatible result.

Definitions follow `vllm/benchmarks/serve.py::calculate_metrics`:
- TTFT: send to first content chunk; ITL: every gap between content chunks; E2EL: send to last
  byte; TPOT per request: (E2EL - TTFT) / (output_tokens - 1), only when output_tokens > 1.
- Statistic keys: `mean_{m}_ms`, `median_{m}_ms`, `std_{m}_ms`, `p{P}_{m}_ms`.

Differences, because the load generator can be cut off by `--duration` and has a warm-up:
- The measurement window starts at the end of the warm-up and ends at the last completion or at
  the hard stop, whichever comes first; `duration` is its length.
- `completed`/`failed` count requests that ended inside the window; output tokens are those
  received inside the window (requests still streaming at either edge contribute their share),
  so throughput is unbiased by requests in flight at the edges.
- Latency statistics use the requests sent inside the window: those that completed inside it, and
  those still in flight at its end (cut off by the hard stop, or still streaming). A request in flight
  is a right-censored observation: its latency is at least its elapsed time (its TTFT too while no
  token came; the gap since its last token is a lower bound of an inter-token latency). When there
  are such requests the percentiles are Kaplan-Meier estimates, so an overloaded run cannot read fast
  by counting only the requests that got through; a percentile the censored requests leave open is
  +inf. Without censored requests the percentiles are numpy's, as `vllm bench serve`'s. No sample at
  all gives no statistic (None), never 0.
- `samples` counts the requests behind the percentiles, `in_flight` the censored ones; `measure_start`
  and `measure_end` give the window in epoch seconds (wall clock), for the operator's queries.
- All times are multiplied by `time_scale` (the twin runs `time_scale` times faster than a real
  GPU), so figures read as the simulated GPU would give them; throughputs are divided by it.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestRecord:
    """One request as the client saw it; times are wall-clock seconds (loop.time())."""

    sent_at: float
    prompt_tokens: int
    success: bool = False
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    finished_at: float = 0.0
    output_tokens: int = 0
    itls_s: array[float] = field(default_factory=lambda: array("d"))
    error: str = ""
    last_token_at: float = 0.0
    """When the last content chunk arrived (0: none yet)."""


@dataclass(frozen=True)
class ClientWindow:
    """The load generator's measurement window in wall-clock seconds and the tokens received inside it (the
    operator's `core.measurement.Window` is the same span as Prometheus is asked for it, in datetimes)."""

    start: float
    end: float
    output_tokens: int
    max_output_tokens_per_s: float = 0.0
    max_concurrent_requests: int = 0

    @property
    def duration_s(self) -> float:
        return max(self.end - self.start, 1e-9)


def percentile_key(p: float) -> str:
    """`99` -> "p99", `99.9` -> "p99.9" (vLLM strips a trailing `.0`)."""
    text = str(float(p))
    return "p" + (text[:-2] if text.endswith(".0") else text)


def censored_quantile(events: Any, censored: Any, q: float) -> float:
    """The q-quantile (0..1) of a latency from exact observations and right-censored ones (Kaplan-Meier).

    A censored value is a lower bound (a request still in flight). The estimate is the smallest event
    time at which the estimated share of latencies at or below it reaches q; +inf when the censored
    observations leave it open (too many requests still running past every finished one).
    """
    return censored_quantiles(events, censored, (q,))[0]


def censored_quantiles(events: Any, censored: Any, qs: tuple[float, ...]) -> tuple[float, ...]:
    """`censored_quantile` at each of `qs`, in one pass over the sorted observations (a run's summary is computed
    after its window, on a CPU the trial pods share)."""
    points = sorted([(float(t), 1) for t in events] + [(float(t), 0) for t in censored])
    found: dict[int, float] = {}
    order = sorted(range(len(qs)), key=lambda k: qs[k])  # the survival curve only falls: quantiles in order
    at_risk, survival, i, next_q = len(points), 1.0, 0, 0
    while i < len(points) and next_q < len(order):
        t, deaths, gone = points[i][0], 0, 0
        while i < len(points) and points[i][0] == t:
            deaths += points[i][1]
            gone += 1
            i += 1
        if deaths:
            survival *= 1.0 - deaths / at_risk
            while next_q < len(order) and 1.0 - survival >= qs[order[next_q]] - 1e-12:
                found[order[next_q]] = t
                next_q += 1
        at_risk -= gone
    return tuple(found.get(k, math.inf) for k in range(len(qs)))


def metric_stats(name: str, values_s: Any, percentiles: tuple[float, ...], scale: float,
                 censored_s: Any = ()) -> dict[str, float | None]:
    """mean/median/std/pP in milliseconds for one metric; None for an empty sample.

    With censored values (lower bounds) the percentiles and the median are Kaplan-Meier estimates and
    the mean is a lower bound (each censored value taken as its bound).
    """
    data = np.asarray(values_s, dtype=float) * 1000.0 * scale
    bounds = np.asarray(censored_s, dtype=float) * 1000.0 * scale
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *(f"{percentile_key(p)}_{name}_ms"
                                                                        for p in percentiles)]
    if data.size + bounds.size == 0:
        return dict.fromkeys(keys)
    both = np.concatenate([data, bounds])
    out: dict[str, float | None] = {f"mean_{name}_ms": float(np.mean(both)), f"std_{name}_ms": float(np.std(both))}
    if bounds.size == 0:
        # The median as percentile 50 (the same value): np.median imports numpy.ma, 17 ms of a starved pod's CPU.
        median, *rest = (float(v) for v in np.percentile(data, [50.0, *percentiles]))
    else:
        median, *rest = censored_quantiles(data, bounds, (0.5, *(p / 100 for p in percentiles)))
    out[f"median_{name}_ms"] = median
    for p, value in zip(percentiles, rest, strict=True):
        out[f"{percentile_key(p)}_{name}_ms"] = value
    return out


def compute_result(
    records: list[RequestRecord],
    window: ClientWindow,
    *,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    time_scale: float = 1.0,
    wall_offset: float | None = None,
    goodput_ms: tuple[tuple[str, float], ...] = (),
) -> dict[str, Any]:
    """The result keys of `vllm bench serve` (results part) for the window.

    `records` may include requests still in flight at the window's end (neither success nor error,
    or finished after it); `wall_offset` (epoch seconds minus the loop clock) adds the window's epoch
    bounds as `measure_start`/`measure_end`.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    ended = [r for r in records if window.start <= r.finished_at <= window.end and (r.success or r.error)]
    ok = [r for r in ended if r.success]
    failed = [r for r in ended if not r.success]
    measured = [r for r in ok if r.sent_at >= window.start]
    running = [r for r in records if window.start <= r.sent_at <= window.end and not r.error
               and not (r.success and r.finished_at <= window.end)]
    duration = window.duration_s * time_scale
    total_input = sum(r.prompt_tokens for r in ok)
    sent = sum(1 for r in records if window.start <= r.sent_at <= window.end)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": window.output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(1 for r in ok if is_good(r, goodput_ms, time_scale)) / duration
                            if goodput_ms else None),
        "output_throughput": window.output_tokens / duration,
        "total_token_throughput": (total_input + window.output_tokens) / duration,
        "max_output_tokens_per_s": window.max_output_tokens_per_s / time_scale,
        "max_concurrent_requests": window.max_concurrent_requests,
        "samples": len(measured) + len(running),
        "in_flight": len(running),
        "offered_request_rate": sent / duration,
    }
    if wall_offset is not None:
        result["measure_start"] = round(window.start + wall_offset, 3)
        result["measure_end"] = round(window.end + wall_offset, 3)
    end = window.end
    samples: dict[str, Any] = {
        "ttft": [r.ttft_s for r in measured] + [r.ttft_s for r in running if r.last_token_at],
        "tpot": [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in measured if r.output_tokens > 1],
        "itl": np.concatenate([np.frombuffer(r.itls_s, dtype=float) for r in measured + running])
        if measured or running else [],
        "e2el": [r.e2el_s for r in measured],
    }
    censored: dict[str, list[float]] = {
        "ttft": [end - r.sent_at for r in running if not r.last_token_at],
        "tpot": [],
        "itl": [end - r.last_token_at for r in running if r.last_token_at],
        "e2el": [end - r.sent_at for r in running],
    }
    for name in percentile_metrics:
        if name not in samples:
            raise ValueError(f"percentile metric {name!r} is not one of {sorted(samples)}")
        result.update(metric_stats(name, samples[name], percentiles, time_scale, censored[name]))
    if failed:
        result["errors_sample"] = sorted({r.error for r in failed})[:5]
    return result


GOODPUT_KEYS = ("ttft", "tpot", "e2el")
"""What `--goodput KEY:MS` may bound, as `vllm bench serve --goodput` (the DistServe definition)."""


def is_good(record: RequestRecord, goodput_ms: tuple[tuple[str, float], ...], time_scale: float = 1.0) -> bool:
    """Whether a completed request met every goodput target (milliseconds, in the simulated time)."""
    ms = 1000.0 * time_scale
    for key, limit in goodput_ms:
        if key == "ttft":
            value = record.ttft_s * ms
        elif key == "tpot":
            if record.output_tokens <= 1:
                continue
            value = (record.e2el_s - record.ttft_s) / (record.output_tokens - 1) * ms
        elif key == "e2el":
            value = record.e2el_s * ms
        else:
            raise ValueError(f"goodput key {key!r} is not one of {', '.join(GOODPUT_KEYS)}")
        if value > limit:
            return False
    return True


SUMMARY_KEYS = (
    "request_goodput", "completed", "failed", "samples", "in_flight", "offered_request_rate", "measure_start", "measure_end", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "p50", "p90", "p95", "p99")),
    "max_concurrency", "request_rate", "time_scale", "warmup_ended", "warmup_elapsed_s",
)  # every percentile an SLO may name, for the operator's verdicts
SUMMARY_LIMIT_BYTES = 4096


def compact_summary(result: dict[str, Any], limit: int = SUMMARY_LIMIT_BYTES) -> str:
    """A JSON summary under `limit` bytes for a termination message (rounded, key subset)."""
    summary: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        if result.get(key) is not None:
            value = result[key]
            if isinstance(value, float) and math.isinf(value):
                value = 1e12  # JSON has no infinity: a percentile the in-flight requests leave open
            summary[key] = round(value, 3) if isinstance(value, float) else value
    if "errors_sample" in result:
        summary["errors_sample"] = [str(e)[:200] for e in result["errors_sample"][:3]]
    text = _dumps(summary)
    while len(text.encode()) > limit and summary:
        summary.popitem()
        text = _dumps(summary)
    return text


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
