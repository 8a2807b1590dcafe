"""The workload profile: length distributions from real-looking vLLM buckets, arrivals, drift, the margin."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime

import pytest

from batchtune.api import WorkloadRecord
from batchtune.core.workload import (
    MIN_BURSTINESS_WINDOWS,
    DriftThresholds,
    LengthDistribution,
    WorkloadObservation,
    arrivals_from_counts,
    beats_by_margin,
    bucket_text,
    build_profile,
    burstiness_from_counts,
    counts_to_cumulative,
    drift,
    drift_trigger,
    improvement_percent,
    ks_distance,
    parse_bucket_text,
)

# vLLM's build_1_2_5_buckets(max_model_len=2048), as in the real scrape (metrics-exposition.txt).
BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, math.inf)


def cumulative(per_bucket: dict[float, float]) -> tuple[tuple[float, float], ...]:
    """`le` buckets as Prometheus' `sum by (le) (increase(..._bucket[...]))` gives them."""
    return tuple(counts_to_cumulative([(b, per_bucket.get(b, 0.0)) for b in BOUNDS]))


CHAT_PROMPTS = cumulative({50.0: 120, 100.0: 400, 200.0: 380, 500.0: 100})        # short chat
LONG_PROMPTS = cumulative({500.0: 50, 1000.0: 450, 2000.0: 500})                    # long documents
CHAT_OUTPUTS = cumulative({20.0: 100, 50.0: 300, 100.0: 450, 200.0: 150})


def observation(prompt=CHAT_PROMPTS, output=CHAT_OUTPUTS, counts=None, **kw) -> WorkloadObservation:
    counts = tuple(counts if counts is not None else [16.7] * 60)
    return WorkloadObservation(3600, prompt, output, kw.pop("prompt_mean", None), kw.pop("output_mean", None),
                               counts, 60, **kw)


# ---- length distributions ----------------------------------------------------------------------


def test_the_real_scrape_reads_as_a_distribution():
    # metrics-exposition.txt: 3 requests, prompt lengths 5, 10 and 50 buckets (sum 36).
    real = [(1.0, 0.0), (2.0, 0.0), (5.0, 1.0), (10.0, 2.0), (20.0, 2.0), (50.0, 3.0), (100.0, 3.0), (200.0, 3.0),
            (500.0, 3.0), (1000.0, 3.0), (2000.0, 3.0), (math.inf, 3.0)]
    dist = LengthDistribution.from_cumulative(real, mean=36 / 3)
    assert dist.total == 3 and dist.mean == 12
    assert [c for _, c in dist.buckets if c] == [1.0, 1.0, 1.0]
    assert dist.quantile(0.5) == pytest.approx(7.5)  # halfway through (5, 10]: rank 1.5 of 3


def test_quantiles_interpolate_inside_buckets_as_histogram_quantile():
    dist = LengthDistribution.from_cumulative(CHAT_PROMPTS)
    assert dist.total == 1000
    # rank 500: 120 below 50, 400 in (50, 100] -> 100; then 380 in (100, 200]: (500 - 520) < 0 -> inside (50, 100]
    assert dist.quantile(0.5) == pytest.approx(50 + 50 * (500 - 120) / 400)
    assert dist.quantile(0.9) == pytest.approx(100 + 100 * (900 - 520) / 380)
    assert dist.cdf(100) == pytest.approx(0.52) and dist.cdf(10_000) == 1.0 and dist.cdf(0) == 0.0


def test_unordered_and_non_monotonic_buckets_are_repaired_not_trusted():
    # increase() extrapolates each bucket series alone: a bucket can come back a hair below the one under it.
    pairs = [(100.0, 10.0), (50.0, 4.0), (math.inf, 10.0), (200.0, 9.999), (20.0, float("nan"))]
    dist = LengthDistribution.from_cumulative(pairs)
    assert [b for b, _ in dist.buckets] == [20.0, 50.0, 100.0, 200.0, math.inf]
    assert all(c >= 0 for _, c in dist.buckets) and dist.total == pytest.approx(10.0)


@pytest.mark.parametrize("buckets", [
    pytest.param(((1.0, 3.0), (1.0, 4.0)), id="duplicate-bound"),
    pytest.param(((5.0, 1.0), (2.0, 1.0)), id="descending"),
    pytest.param(((5.0, -1.0),), id="negative"),
    pytest.param(((0.0, 1.0),), id="zero-bound"),
])
def test_a_malformed_distribution_is_refused(buckets):
    with pytest.raises(ValueError):
        LengthDistribution(buckets)


def test_an_empty_distribution_has_no_quantile_and_cannot_be_sampled():
    empty = LengthDistribution.from_cumulative(cumulative({}))
    assert empty.total == 0 and empty.quantile(0.5) is None and empty.bucket_mean() is None
    with pytest.raises(ValueError):
        empty.sample(random.Random(0))


@pytest.mark.parametrize("per_bucket", [
    pytest.param({50.0: 120, 100.0: 400, 200.0: 380, 500.0: 100}, id="chat"),
    pytest.param({500.0: 50, 1000.0: 450, 2000.0: 500}, id="long"),
    pytest.param({5.0: 1, 2000.0: 3}, id="sparse-and-bimodal"),
    pytest.param({1.0: 10}, id="one-token-only"),
])
def test_the_sampler_reproduces_the_bucket_shares_within_two_points(per_bucket):
    dist = LengthDistribution.from_cumulative(cumulative(per_bucket))
    rng = random.Random(7)
    samples = [dist.sample(rng) for _ in range(20_000)]
    assert min(samples) >= 1 and max(samples) <= 2000
    for i, (bound, share) in enumerate(dist.shares()):
        lower = dist.buckets[i - 1][0] if i else 0
        seen = sum(1 for s in samples if lower < s <= bound) / len(samples)
        assert seen == pytest.approx(share, abs=0.02), f"bucket ({lower}, {bound}]"
    assert sum(samples) / len(samples) == pytest.approx(dist.bucket_mean(), rel=0.03)


def test_the_sampler_is_deterministic_per_seed():
    dist = LengthDistribution.from_cumulative(LONG_PROMPTS)
    draw = [dist.sample(random.Random(3)) for _ in range(5)]
    assert draw == [dist.sample(random.Random(3)) for _ in range(5)]
    rng_a, rng_b = random.Random(1), random.Random(2)
    assert [dist.sample(rng_a) for _ in range(20)] != [dist.sample(rng_b) for _ in range(20)]


def test_bucket_text_round_trips_and_names_a_bad_item():
    dist = LengthDistribution.from_cumulative(CHAT_PROMPTS)
    assert parse_bucket_text(bucket_text(dist)).buckets == dist.buckets
    assert bucket_text(dist).endswith("inf:0")
    with pytest.raises(ValueError, match="'50'"):
        parse_bucket_text("20:1,50")


# ---- arrivals and burstiness ----------------------------------------------------------------------


def gamma_counts(rate: float, shape: float, windows: int, window_s: float, seed: int) -> list[float]:
    """Arrivals with gamma inter-arrival times (mean 1/rate, shape `shape`) counted per window."""
    rng = random.Random(seed)
    t, counts = 0.0, [0.0] * windows
    theta = 1.0 / (rate * shape)
    while True:
        t += rng.gammavariate(shape, theta)
        index = int(t // window_s)
        if index >= windows:
            return counts
        counts[index] += 1


@pytest.mark.parametrize("shape", [0.25, 0.5, 1.0, 2.0])
def test_burstiness_is_recovered_from_counts_of_gamma_arrivals(shape):
    estimates = [burstiness_from_counts(gamma_counts(5.0, shape, 240, 60.0, seed)) for seed in range(5)]
    mean = sum(e for e in estimates if e is not None) / len(estimates)
    assert mean == pytest.approx(shape, rel=0.25)


def test_a_slow_trend_in_the_rate_is_not_read_as_burstiness():
    # Poisson arrivals whose rate doubles over the hour: raw variance/mean would say "bursty".
    rng = random.Random(5)
    counts = []
    for i in range(60):
        rate = 60 * (3.0 + 3.0 * i / 59)
        counts.append(float(sum(1 for _ in range(int(rate * 3)) if rng.random() < 1 / 3)))
    raw = sum((c - sum(counts) / 60) ** 2 for c in counts) / 60 / (sum(counts) / 60)
    assert 1 / raw < 0.5  # a naive estimate reads a trend as bursts
    assert burstiness_from_counts(counts) == pytest.approx(1.5, rel=0.5)  # binomial thinning: a bit regular


@pytest.mark.parametrize("counts, why", [
    pytest.param([30.0] * (MIN_BURSTINESS_WINDOWS - 1), "too-few-windows", id="too-few-windows"),
    pytest.param([1.0, 0.0] * 30, "sparse", id="sparse"),
])
def test_burstiness_is_unknown_when_the_counts_cannot_tell(counts, why):
    assert burstiness_from_counts(counts) is None


def test_arrivals_give_mean_and_peak_per_second():
    counts = [60.0] * 50 + [240.0] + [60.0] * 9
    arrivals = arrivals_from_counts(counts, 60)
    assert arrivals is not None
    assert arrivals.mean_per_second == pytest.approx(sum(counts) / 60 / 60)
    assert arrivals.peak_per_second == pytest.approx(4.0) and arrivals.windows == 60
    assert arrivals_from_counts([], 60) is None
    assert arrivals_from_counts([math.nan, math.nan], 60) is None


# ---- the profile --------------------------------------------------------------------------------


def test_a_profile_from_production_names_its_lookback_rate_and_lengths():
    obs = observation(prompt_mean=130.0, output_mean=70.0, counts=gamma_counts(1000 / 3600, 1.0, 60, 60, 1),
                      prefix_cache_hits=250.0, prefix_cache_queries=1000.0)
    result = build_profile(obs)
    assert result.problem is None and result.profile is not None
    profile = result.profile
    assert profile.requests == 1000 and profile.lookback_seconds == 3600
    assert profile.prompt_mean == 130.0 and profile.output_mean == 70.0
    assert profile.prefix_cache_hit_percent == 25.0
    summary = profile.summary()
    assert summary.startswith("production over 1h (1000 requests)") and "prompt mean 130" in summary
    assert "prefix-cache hits 25%" in summary


@pytest.mark.parametrize("obs, words", [
    pytest.param(observation(prompt=()), "no prompt length histogram", id="no-histogram"),
    pytest.param(observation(prompt=(), output=()), "no prompt or output length histogram", id="neither"),
    pytest.param(observation(prompt=cumulative({}), output=cumulative({})), "served 0 request(s) in the last 1h",
                 id="empty-buckets"),
    pytest.param(observation(prompt=cumulative({50.0: 30}), output=cumulative({20.0: 30})),
                 "served 30 request(s) in the last 1h; a profile needs at least 100", id="sparse"),
])
def test_too_little_data_is_a_stated_problem_never_a_default(obs, words):
    result = build_profile(obs)
    assert result.profile is None and words in (result.problem or "")


def test_unmeasured_arrivals_are_said_not_assumed_silently():
    result = build_profile(observation(counts=[]))
    assert result.profile is not None and result.profile.burstiness == 1.0
    assert "no request-rate series" in result.profile.notes[0]
    result = build_profile(observation(counts=[100.0] * 5))
    assert result.profile is not None and result.profile.arrivals.burstiness is None
    assert "burstiness not measured (5 windows of 60s" in result.profile.notes[0]


def test_the_prefix_cache_rate_is_absent_where_not_exposed():
    assert build_profile(observation()).profile.prefix_cache_hit_percent is None
    assert build_profile(observation(prefix_cache_hits=0.0, prefix_cache_queries=0.0)).profile \
        .prefix_cache_hit_percent is None


# ---- drift ----------------------------------------------------------------------------------------


def profile(prompt=CHAT_PROMPTS, counts=None):
    result = build_profile(observation(prompt=prompt, counts=counts))
    assert result.profile is not None
    return result.profile


def test_ks_distance_is_zero_for_the_same_shape_and_large_for_a_shift():
    a = LengthDistribution.from_cumulative(CHAT_PROMPTS)
    doubled = LengthDistribution.from_cumulative([(b, 2 * c) for b, c in CHAT_PROMPTS])
    assert ks_distance(a, doubled) == pytest.approx(0.0)  # more traffic, same shape
    assert ks_distance(a, LengthDistribution.from_cumulative(LONG_PROMPTS)) > 0.9
    assert ks_distance(a, LengthDistribution.from_cumulative(cumulative({}))) is None


def test_ks_distance_compares_different_bucket_layouts():
    coarse = LengthDistribution(((100.0, 50.0), (1000.0, 50.0)))
    fine = LengthDistribution(((50.0, 25.0), (100.0, 25.0), (550.0, 25.0), (1000.0, 25.0)))
    assert ks_distance(coarse, fine) == pytest.approx(0.0, abs=1e-9)


def test_drift_from_chat_to_long_prompts_triggers_and_a_small_change_does_not():
    reference = profile(counts=[60.0] * 60)
    thresholds = DriftThresholds(length_shift_percent=20, peak_rate_change_percent=50)
    shifted = drift(reference, profile(prompt=LONG_PROMPTS, counts=[60.0] * 60))
    assert shifted.prompt_shift_percent > 90 and shifted.output_shift_percent == pytest.approx(0.0)
    why = drift_trigger(shifted, thresholds)
    assert why and "prompt-length distribution shifted" in why and "spec.retune.drift.lengthShiftPercent" in why
    nudged = cumulative({50.0: 110, 100.0: 400, 200.0: 390, 500.0: 100})
    assert drift_trigger(drift(reference, profile(prompt=nudged, counts=[66.0] * 60)), thresholds) is None


@pytest.mark.parametrize("level, fires", [(100.0, True), (25.0, True), (80.0, False), (35.0, False)])
def test_a_peak_rate_change_triggers_past_its_threshold_either_way(level, fires):
    reference = profile(counts=[60.0] * 60)
    current = profile(counts=[level] * 60)
    why = drift_trigger(drift(reference, current), DriftThresholds(peak_rate_change_percent=50))
    assert (why is not None) is fires
    if fires:
        assert "spec.retune.drift.peakRateChangePercent" in why


def test_a_rate_without_its_series_is_no_peak_to_compare():
    # A production younger than the lookback has no full rate window yet: its rate is the lookback's
    # count over the lookback, 20x too quiet here, and must not read as a 2000% busier production later.
    young = profile(counts=())
    assert not young.rate_measured and young.arrivals.peak_per_second == pytest.approx(1000 / 3600)
    busy = profile(counts=[360.0] * 60)
    assert busy.rate_measured
    moved = drift(young, busy)
    assert moved.peak_change_percent is None and "peakChangePercent" not in moved.to_metrics()
    assert drift_trigger(moved, DriftThresholds(peak_rate_change_percent=50)) is None
    assert drift(busy, young).peak_change_percent is None
    # Stored in status and read back, it is still a rate without its series.
    again = WorkloadRecord.of(young, datetime(2026, 1, 1, tzinfo=UTC)).profile()
    assert again is not None and not again.rate_measured
    assert drift(busy, profile(counts=[720.0] * 60)).peak_change_percent == pytest.approx(100.0)


def test_an_unwatched_drift_never_triggers():
    reference = profile(counts=[60.0] * 60)
    assert drift_trigger(drift(reference, profile(prompt=LONG_PROMPTS, counts=[600.0] * 60)),
                         DriftThresholds()) is None


# ---- the improvement margin -----------------------------------------------------------------------


@pytest.mark.parametrize("candidate, current, margin, beats", [
    pytest.param(10.6, 10.0, 5, True, id="six-percent-beats-five"),
    pytest.param(10.4, 10.0, 5, False, id="four-percent-does-not"),
    pytest.param(10.5, 10.0, 5, True, id="exactly-the-margin"),
    pytest.param(10.0, 10.0, 0, False, id="a-tie-never-changes-production"),
    pytest.param(9.0, 10.0, 0, False, id="worse"),
    pytest.param(1.0, None, 50, True, id="current-missed-the-slo"),
    pytest.param(None, 10.0, 0, False, id="candidate-unmeasured"),
    pytest.param(math.nan, 10.0, 0, False, id="candidate-nan"),
])
def test_the_improvement_margin(candidate, current, margin, beats):
    assert beats_by_margin(candidate, current, margin) is beats


def test_improvement_percent():
    assert improvement_percent(12.0, 10.0) == pytest.approx(20.0)
    assert improvement_percent(5.0, 0.0) == math.inf
    assert improvement_percent(None, 1.0) is None
