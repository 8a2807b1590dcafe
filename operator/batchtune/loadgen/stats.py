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
- Latency statistics use the completed requests that were also sent inside the window.
- All times are multiplied by `time_scale` (the twin runs `time_scale` times faster than a real
  GPU), so figures read as the simulated GPU would give them; throughputs are divided by it.
"""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class Window:
    """The measurement window in wall-clock seconds and the tokens received inside it."""

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


def metric_stats(name: str, values_s: list[float] | np.ndarray, percentiles: tuple[float, ...], scale: float) -> dict[str, float]:
    """mean/median/std/pP in milliseconds for one metric; zeros for an empty sample (as vLLM)."""
    data = np.asarray(values_s, dtype=float) * 1000.0 * scale
    if data.size == 0:
        data = np.zeros(1)
    out = {
        f"mean_{name}_ms": float(np.mean(data)),
        f"median_{name}_ms": float(np.median(data)),
        f"std_{name}_ms": float(np.std(data)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(data, p))
    return out


def compute_result(
    records: list[RequestRecord],
    window: Window,
    *,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    time_scale: float = 1.0,
) -> dict[str, Any]:
    """The result keys of `vllm bench serve` (results part) for the window."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    ended = [r for r in records if window.start <= r.finished_at <= window.end]
    ok = [r for r in ended if r.success]
    failed = [r for r in ended if not r.success]
    measured = [r for r in ok if r.sent_at >= window.start]
    duration = window.duration_s * time_scale
    total_input = sum(r.prompt_tokens for r in ok)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_input,
        "total_output_tokens": window.output_tokens,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": window.output_tokens / duration,
        "total_token_throughput": (total_input + window.output_tokens) / duration,
        "max_output_tokens_per_s": window.max_output_tokens_per_s / time_scale,
        "max_concurrent_requests": window.max_concurrent_requests,
    }
    samples: dict[str, Any] = {
        "ttft": [r.ttft_s for r in measured],
        "tpot": [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in measured if r.output_tokens > 1],
        "itl": np.concatenate([np.frombuffer(r.itls_s, dtype=float) for r in measured]) if measured else [],
        "e2el": [r.e2el_s for r in measured],
    }
    for name in percentile_metrics:
        if name not in samples:
            raise ValueError(f"percentile metric {name!r} is not one of {sorted(samples)}")
        result.update(metric_stats(name, samples[name], percentiles, time_scale))
    if failed:
        result["errors_sample"] = sorted({r.error for r in failed})[:5]
    return result


SUMMARY_KEYS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "p50", "p90", "p95", "p99")),
    "max_concurrency", "request_rate", "time_scale",
)  # every percentile an SLO may name, for the operator's verdicts
SUMMARY_LIMIT_BYTES = 4096


def compact_summary(result: dict[str, Any], limit: int = SUMMARY_LIMIT_BYTES) -> str:
    """A JSON summary under `limit` bytes for a termination message (rounded, key subset)."""
    summary: dict[str, Any] = {}
    for key in SUMMARY_KEYS:
        if key in result:
            value = result[key]
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
