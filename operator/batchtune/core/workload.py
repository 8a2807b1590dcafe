"""Production's workload: length distributions, arrival rate and burstiness, drift. Pure.

A profile is measured over a stated lookback from the engine's own series (vLLM:
`vllm:request_prompt_tokens` and `vllm:request_generation_tokens` histograms, the finished-request
counter, the prefix-cache counters where exposed):

- a length distribution is the histogram's per-bucket increase over the lookback; quantiles
  interpolate linearly inside a bucket (as PromQL's `histogram_quantile`), and a sample is a bucket
  drawn by its share, then a length uniform inside it;
- the arrival profile comes from the request counts of consecutive windows: the mean and peak rate,
  and the burstiness, the shape of gamma-distributed inter-arrival times (1: Poisson, below 1:
  burstier), which is what `vllm bench serve --burstiness` means. For a gamma renewal process the
  counts' index of dispersion (variance over mean) tends to 1/shape; the variance is taken from
  successive differences so that a slow trend in the rate is not read as burstiness;
- drift between two profiles is the Kolmogorov-Smirnov distance of their length distributions (the
  largest gap between the two cumulative shares, on the union of bucket bounds) and the relative
  change of the peak rate.

Too little data is never a default: `build_profile` says what is missing instead.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MIN_PROFILE_REQUESTS = 100
"""Requests a profile needs over its lookback, unless the spec says otherwise."""
MIN_BURSTINESS_WINDOWS = 10
"""Rate windows the burstiness estimate needs (fewer: it is not measured)."""
MIN_REQUESTS_PER_WINDOW = 2.0
"""Mean requests per window below which counts are too sparse to tell bursts from noise."""
BURSTINESS_RANGE = (0.05, 20.0)
"""Burstiness is clamped to this range (a perfectly regular stream would read as infinite)."""


# ---- length distributions -----------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths as a histogram: (upper bound, requests in (previous bound, bound]), ascending.

    The last bound may be +inf (a length above every finite bound). `mean` is the exact mean
    (`_sum / _count`) when the engine gave it.
    """

    buckets: tuple[tuple[float, float], ...]
    mean: float | None = None

    def __post_init__(self) -> None:
        bounds = [b for b, _ in self.buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"bucket bounds must be strictly ascending, got {bounds}")
        if any(not (c >= 0) for _, c in self.buckets):  # catches NaN too
            raise ValueError("bucket counts must be >= 0")
        if self.buckets and self.buckets[0][0] <= 0:
            raise ValueError(f"the first bucket bound must be > 0, got {self.buckets[0][0]}")

    @classmethod
    def from_cumulative(cls, pairs: Iterable[tuple[float, float]], mean: float | None = None) -> LengthDistribution:
        """From Prometheus `le` buckets (cumulative counts, any order).

        Increases over a window can come back slightly non-monotonic (extrapolation, a counter reset
        in one series): as `histogram_quantile` does, a bucket never counts less than the one below it.
        NaN counts read as zero.
        """
        cleaned = sorted((float(le), float(count) if math.isfinite(count) else 0.0)
                         for le, count in pairs if not math.isnan(le) and le > 0)
        buckets: list[tuple[float, float]] = []
        below = 0.0
        for le, cumulative in cleaned:
            cumulative = max(cumulative, below)
            if buckets and buckets[-1][0] == le:
                continue
            buckets.append((le, cumulative - below))
            below = cumulative
        finite_mean = mean if mean is not None and math.isfinite(mean) and mean > 0 else None
        return cls(tuple(buckets), finite_mean)

    @property
    def total(self) -> float:
        return sum(c for _, c in self.buckets)

    def _lower(self, i: int) -> float:
        return self.buckets[i - 1][0] if i > 0 else 0.0

    def _upper(self, i: int) -> float:
        upper = self.buckets[i][0]
        if math.isinf(upper):
            lower = self._lower(i)
            return max(2.0 * lower, lower + 1.0)  # above every finite bound: assume up to twice the last
        return upper

    def cdf(self, x: float) -> float:
        """Share of lengths at or below x (linear inside a bucket); 0 for an empty distribution."""
        total = self.total
        if total <= 0:
            return 0.0
        below = 0.0
        for i, (_, count) in enumerate(self.buckets):
            lower, upper = self._lower(i), self._upper(i)
            if x >= upper:
                below += count
                continue
            if x > lower:
                below += count * (x - lower) / (upper - lower)
            break
        return min(1.0, below / total)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q < 1), interpolated inside its bucket; None when empty."""
        if not 0 < q < 1:
            raise ValueError(f"quantile {q!r} is outside (0, 1)")
        total = self.total
        if total <= 0:
            return None
        rank = q * total
        below = 0.0
        for i, (_, count) in enumerate(self.buckets):
            if count > 0 and below + count >= rank:
                lower, upper = self._lower(i), self._upper(i)
                return lower + (upper - lower) * (rank - below) / count
            below += count
        return self._upper(len(self.buckets) - 1)

    def bucket_mean(self) -> float | None:
        """The mean the sampler reproduces (bucket midpoints); None when empty."""
        total = self.total
        if total <= 0:
            return None
        return sum(c * sum(self._integer_range(i)) / 2 for i, (_, c) in enumerate(self.buckets)) / total

    def _integer_range(self, i: int) -> tuple[int, int]:
        """The whole lengths bucket i holds: (lower, upper] as integers, at least 1."""
        low = math.floor(self._lower(i)) + 1
        return low, max(low, math.floor(self._upper(i)))

    def sample(self, rng: random.Random) -> int:
        """One length: a bucket by its share, then an integer uniform inside it (at least 1)."""
        total = self.total
        if total <= 0:
            raise ValueError("cannot sample an empty length distribution")
        pick = rng.random() * total
        chosen = 0
        for i, (_, count) in enumerate(self.buckets):
            if count <= 0:
                continue
            chosen = i
            pick -= count
            if pick < 0:
                break
        return rng.randint(*self._integer_range(chosen))

    def shares(self) -> list[tuple[float, float]]:
        """(bound, share of lengths in the bucket) for display."""
        total = self.total
        return [(b, c / total if total > 0 else 0.0) for b, c in self.buckets]


def ks_distance(a: LengthDistribution, b: LengthDistribution) -> float | None:
    """Largest gap between the two cumulative shares over the union of finite bucket bounds (0..1).

    None when either distribution is empty. Different bucket layouts are compared by linear
    interpolation inside buckets.
    """
    if a.total <= 0 or b.total <= 0:
        return None
    bounds = sorted({x for x, _ in a.buckets + b.buckets if math.isfinite(x)})
    if not bounds:
        return 0.0
    return max(abs(a.cdf(x) - b.cdf(x)) for x in bounds)


# ---- arrivals -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrivalProfile:
    """Request arrivals from counts over consecutive windows of `window_seconds`."""

    mean_per_second: float
    peak_per_second: float
    """The highest window's rate."""
    burstiness: float | None
    """Gamma shape of inter-arrival times (1: Poisson; below 1: burstier); None: too few windows to tell."""
    window_seconds: int
    windows: int


def arrivals_from_counts(counts: Sequence[float], window_seconds: int) -> ArrivalProfile | None:
    """The arrival profile of per-window request counts; None when no window has a count."""
    if window_seconds < 1:
        raise ValueError(f"window_seconds {window_seconds!r} must be >= 1")
    values = [max(0.0, float(c)) for c in counts if c is not None and math.isfinite(c)]
    if not values:
        return None
    mean_count = sum(values) / len(values)
    burstiness = burstiness_from_counts(values)
    return ArrivalProfile(mean_count / window_seconds, max(values) / window_seconds, burstiness, window_seconds,
                          len(values))


def burstiness_from_counts(counts: Sequence[float]) -> float | None:
    """Gamma shape from counts of consecutive equal windows: mean over the successive-difference variance.

    None with fewer than `MIN_BURSTINESS_WINDOWS` windows or fewer than `MIN_REQUESTS_PER_WINDOW`
    requests a window on average: the estimate would be noise.
    """
    if len(counts) < MIN_BURSTINESS_WINDOWS:
        return None
    mean = sum(counts) / len(counts)
    if mean < MIN_REQUESTS_PER_WINDOW:
        return None
    diffs = [(b - a) ** 2 for a, b in zip(counts, counts[1:], strict=False)]
    variance = sum(diffs) / len(diffs) / 2
    low, high = BURSTINESS_RANGE
    if variance <= 0:
        return high
    return round(min(high, max(low, mean / variance)), 3)


# ---- the profile ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadObservation:
    """What Prometheus gave for one lookback (the reader's answer, before any judgement)."""

    lookback_seconds: int
    prompt_buckets: tuple[tuple[float, float], ...] = ()
    """(le, cumulative increase) of the prompt-length histogram."""
    output_buckets: tuple[tuple[float, float], ...] = ()
    prompt_mean: float | None = None
    output_mean: float | None = None
    request_counts: tuple[float, ...] = ()
    """Finished requests in each consecutive window of `window_seconds` over the lookback."""
    window_seconds: int = 60
    prefix_cache_hits: float | None = None
    """Prompt tokens served from the prefix cache over the lookback (None: not exposed)."""
    prefix_cache_queries: float | None = None
    replicas: int = 1
    """Production's pods the series were summed over (the rates are the whole Deployment's)."""


@dataclass(frozen=True)
class WorkloadProfile:
    """Production's traffic over a lookback: what the trials reproduce and what drift is measured against."""

    lookback_seconds: int
    requests: int
    prompt: LengthDistribution
    output: LengthDistribution
    arrivals: ArrivalProfile | None
    prefix_cache_hit_percent: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    replicas: int = 1
    """Production's pods when measured: the rates are theirs together; one trial is one replica."""

    @property
    def rate_measured(self) -> bool:
        """Whether the rates come from the request-rate series (windows shorter than the lookback).

        Without that series the rate is the lookback's count over its length (said in `notes`), which
        reads far too quiet for a production younger than the lookback: no peak to compare.
        """
        return self.arrivals is not None and self.arrivals.window_seconds < self.lookback_seconds

    def peak_per_replica(self) -> float | None:
        """Production's peak rate over its replicas: what one trial pod would face."""
        if self.arrivals is None:
            return None
        return self.arrivals.peak_per_second / max(1, self.replicas)

    @property
    def prompt_mean(self) -> float:
        return _mean(self.prompt)

    @property
    def output_mean(self) -> float:
        return _mean(self.output)

    @property
    def burstiness(self) -> float:
        """The gamma shape the load generator uses: the measured one, else 1 (Poisson, said in `notes`)."""
        if self.arrivals is None or self.arrivals.burstiness is None:
            return 1.0
        return self.arrivals.burstiness

    def summary(self) -> str:
        """One line naming the workload: rate, burstiness and the length distributions."""
        parts = []
        if self.arrivals is not None:
            burst = (f"burstiness {self.arrivals.burstiness:.2g}" if self.arrivals.burstiness is not None
                     else "burstiness unmeasured")
            parts.append(f"{self.arrivals.mean_per_second:.3g} req/s mean, {self.arrivals.peak_per_second:.3g} peak, "
                         f"{burst}")
        for name, dist in (("prompt", self.prompt), ("output", self.output)):
            p50, p90 = dist.quantile(0.5), dist.quantile(0.9)
            parts.append(f"{name} mean {_mean(dist):.0f} p50 {p50 or 0:.0f} p90 {p90 or 0:.0f} tokens")
        if self.prefix_cache_hit_percent is not None:
            parts.append(f"prefix-cache hits {self.prefix_cache_hit_percent:.0f}%")
        over = f", {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"production over {_duration(self.lookback_seconds)} ({self.requests} requests{over}): "
                + "; ".join(parts))


def _mean(dist: LengthDistribution) -> float:
    if dist.mean is not None:
        return dist.mean
    return dist.bucket_mean() or 0.0


def _duration(seconds: int) -> str:
    if seconds % 86400 == 0:
        return f"{seconds // 86400}d"
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


@dataclass(frozen=True)
class ProfileResult:
    profile: WorkloadProfile | None
    problem: str | None = None
    """Why there is no profile, in words naming what is missing."""


def build_profile(obs: WorkloadObservation, min_requests: int = MIN_PROFILE_REQUESTS) -> ProfileResult:
    """The profile of one observation, or why there is none (too few requests, no histograms)."""
    span = f"the last {_duration(obs.lookback_seconds)}"
    if not obs.prompt_buckets or not obs.output_buckets:
        missing = [name for name, b in (("prompt", obs.prompt_buckets), ("output", obs.output_buckets)) if not b]
        return ProfileResult(None, f"production exposes no {' or '.join(missing)} length histogram in {span}")
    prompt = LengthDistribution.from_cumulative(obs.prompt_buckets, obs.prompt_mean)
    output = LengthDistribution.from_cumulative(obs.output_buckets, obs.output_mean)
    requests = int(round(min(prompt.total, output.total)))
    if requests < min_requests:
        return ProfileResult(None, f"production served {requests} request(s) in {span}; a profile needs at least "
                                   f"{min_requests}")
    notes: list[str] = []
    arrivals = arrivals_from_counts(obs.request_counts, obs.window_seconds)
    if arrivals is None:
        notes.append("no request-rate series: arrivals are unknown, the open-loop load is Poisson at the "
                     "lookback's mean rate")
        arrivals = ArrivalProfile(requests / obs.lookback_seconds, requests / obs.lookback_seconds, None,
                                  obs.lookback_seconds, 1)
    elif arrivals.burstiness is None:
        notes.append(f"burstiness not measured ({arrivals.windows} windows of {arrivals.window_seconds}s, "
                     f"{arrivals.mean_per_second * arrivals.window_seconds:.1f} requests each on average): "
                     "arrivals are Poisson")
    hit_percent = None
    if obs.prefix_cache_queries is not None and obs.prefix_cache_queries > 0 and obs.prefix_cache_hits is not None:
        hit_percent = round(100.0 * min(1.0, max(0.0, obs.prefix_cache_hits / obs.prefix_cache_queries)), 2)
    if any(math.isinf(b) and c > 0 for b, c in prompt.buckets + output.buckets):
        notes.append("some lengths lie above the histogram's last finite bound: sampled up to twice that bound")
    return ProfileResult(WorkloadProfile(obs.lookback_seconds, requests, prompt, output, arrivals, hit_percent,
                                         tuple(notes), max(1, obs.replicas)))


# ---- drift --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    """How far production's traffic moved from the profile a decision was made for."""

    prompt_shift_percent: float | None
    """KS distance of the prompt-length distributions, in percent (0: the same, 100: disjoint)."""
    output_shift_percent: float | None
    peak_change_percent: float | None
    """Relative change of the peak rate, in percent (positive: busier)."""

    @property
    def length_shift_percent(self) -> float | None:
        values = [v for v in (self.prompt_shift_percent, self.output_shift_percent) if v is not None]
        return max(values) if values else None

    def to_metrics(self) -> dict[str, float]:
        out = {"promptShiftPercent": self.prompt_shift_percent, "outputShiftPercent": self.output_shift_percent,
               "peakChangePercent": self.peak_change_percent}
        return {k: round(v, 2) for k, v in out.items() if v is not None}


def drift(reference: WorkloadProfile, current: WorkloadProfile) -> Drift:
    prompt, output = ks_distance(reference.prompt, current.prompt), ks_distance(reference.output, current.output)
    peak = None
    before, after = reference.arrivals, current.arrivals
    if reference.rate_measured and current.rate_measured and before and after and before.peak_per_second > 0:
        peak = 100.0 * (after.peak_per_second - before.peak_per_second) / before.peak_per_second
    return Drift(None if prompt is None else 100.0 * prompt, None if output is None else 100.0 * output, peak)


@dataclass(frozen=True)
class DriftThresholds:
    """When a drift starts a new round (None: that kind of drift is not watched)."""

    length_shift_percent: int | None = None
    peak_rate_change_percent: int | None = None


def drift_trigger(d: Drift, thresholds: DriftThresholds) -> str | None:
    """Why this drift starts a new round, naming the threshold's field; None when it does not."""
    reasons = []
    length = thresholds.length_shift_percent
    for name, value in (("prompt", d.prompt_shift_percent), ("output", d.output_shift_percent)):
        if length is not None and value is not None and value >= length:
            reasons.append(f"the {name}-length distribution shifted {value:.0f}% (KS distance; threshold {length}%, "
                           "spec.retune.drift.lengthShiftPercent)")
    peak = thresholds.peak_rate_change_percent
    if peak is not None and d.peak_change_percent is not None and abs(d.peak_change_percent) >= peak:
        reasons.append(f"the peak request rate changed {d.peak_change_percent:+.0f}% (threshold {peak}%, "
                       "spec.retune.drift.peakRateChangePercent)")
    return "; ".join(reasons) or None


# ---- the improvement margin ---------------------------------------------------------------------


def improvement_percent(candidate: float | None, current: float | None) -> float | None:
    """How much better the candidate's objective is than the current setting's, in percent.

    +inf when the current setting has no value (it failed, or missed the SLO) and the candidate has
    one; None when the candidate has none.
    """
    if candidate is None or not math.isfinite(candidate):
        return None
    if current is None or not math.isfinite(current) or current <= 0:
        return math.inf
    return 100.0 * (candidate - current) / current


def beats_by_margin(candidate: float | None, current: float | None, margin_percent: float) -> bool:
    """Whether the candidate beats the current setting by at least the margin (and by something)."""
    gain = improvement_percent(candidate, current)
    return gain is not None and gain > 0 and gain >= margin_percent


def bucket_text(dist: LengthDistribution) -> str:
    """`le:count,...` (+Inf as `inf`), the load generator's `--prompt-buckets` form."""
    return ",".join(f"{'inf' if math.isinf(b) else f'{b:g}'}:{c:.6g}" for b, c in dist.buckets)


def parse_bucket_text(text: str) -> LengthDistribution:
    """The inverse of `bucket_text` (per-bucket counts); ValueError names the bad item."""
    pairs: list[tuple[float, float]] = []
    for item in text.split(","):
        if not item.strip():
            continue
        bound, sep, count = item.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((math.inf if bound.strip().lower() in ("inf", "+inf") else float(bound), float(count)))
        except ValueError:
            raise ValueError(f"bucket {item!r} is not BOUND:COUNT") from None
    pairs.sort()
    if not pairs:
        raise ValueError("no bucket given")
    return LengthDistribution(tuple(pairs))


def counts_to_cumulative(buckets: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-bucket counts -> cumulative (`le`) counts."""
    out, running = [], 0.0
    for bound, count in buckets:
        running += count
        out.append((bound, running))
    return out
