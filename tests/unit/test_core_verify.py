"""Verify: production after the change against before it; when to judge; what an inconclusive verify does."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from batchtune.core.slo import SloTargets
from batchtune.core.verify import (
    SERVED_SHARE,
    InconclusivePolicy,
    Next,
    VerifyPolicy,
    VerifyResult,
    inconclusive,
    judge,
    window_state,
)
from batchtune.core.vocabulary import Reason, Verdict

SLO = SloTargets(percentile=95, itl_ms=40, max_error_rate_percent=1, headroom_percent=10)
MAX_REGRESSION = 10
BEFORE = {"itlMs": 48.8, "outputThroughput": 100.0, "errorRatePercent": 0.0, SERVED_SHARE: 100.0}
AFTER = {"itlMs": 30.0, "outputThroughput": 100.0, "errorRatePercent": 0.0, SERVED_SHARE: 100.0}


@pytest.mark.parametrize("after, verdict, fragment", [
    pytest.param({"itlMs": 49.0, "outputThroughput": 102.0}, Verdict.MET, "itlMs 49 ms",
                 id="same-bucket-above-target-is-not-a-regression"),
    pytest.param({}, Verdict.MET, "itlMs 30 ms", id="better"),
    pytest.param({"itlMs": 80.0}, Verdict.VIOLATED, "itlMs 80 ms > 40 ms target, was 48.8 ms",
                 id="latency-worse-and-over-target"),
    pytest.param({"itlMs": math.inf}, Verdict.VIOLATED, "above the highest histogram bucket", id="latency-inf"),
    pytest.param({"outputThroughput": 80.0, SERVED_SHARE: 80.0}, Verdict.VIOLATED, "served 80% of the requests",
                 id="served-share-dropped"),
    pytest.param({"outputThroughput": 80.0}, Verdict.MET, "served 100%",
                 id="throughput-dropped-with-all-offered-served-is-less-traffic"),
    pytest.param({SERVED_SHARE: 91.0}, Verdict.MET, "served 91%", id="served-share-within-tolerance"),
    pytest.param({SERVED_SHARE: None}, Verdict.UNKNOWN, "share of offered requests", id="served-share-missing"),
    pytest.param({SERVED_SHARE: math.nan}, Verdict.UNKNOWN, "share of offered requests", id="served-share-nan"),
    pytest.param({"errorRatePercent": 5.0}, Verdict.VIOLATED, "error rate 5% > 1%, was 0%", id="errors"),
    pytest.param({"errorRatePercent": 0.9}, Verdict.MET, "error rate 0.9%", id="errors-within-the-slo"),
    pytest.param({"errorRatePercent": None}, Verdict.UNKNOWN, "error rate after the change is not measured",
                 id="errors-missing"),
    pytest.param({"itlMs": None}, Verdict.UNKNOWN, "itlMs after the change is not measured", id="latency-missing"),
    pytest.param({"itlMs": math.nan}, Verdict.UNKNOWN, "itlMs after the change is not measured", id="latency-nan"),
    pytest.param({"itlMs": None, "errorRatePercent": 5.0}, Verdict.VIOLATED, "error rate 5%", id="violated-beats-unknown"),
])
def test_judge(after, verdict, fragment):
    result = judge(SLO, MAX_REGRESSION, BEFORE, {**AFTER, **after})
    assert result.verdict is verdict
    assert fragment in result.reason


@pytest.mark.parametrize("before, after, verdict", [
    pytest.param({"errorRatePercent": 5.0}, {"errorRatePercent": 5.4}, Verdict.MET, id="errors-over-slo-but-no-worse"),
    pytest.param({"errorRatePercent": 5.0}, {"errorRatePercent": 5.6}, Verdict.VIOLATED, id="errors-over-slo-and-worse"),
    pytest.param({"errorRatePercent": 0.2}, {"errorRatePercent": 0.9}, Verdict.MET, id="errors-worse-but-within-slo"),
    pytest.param({SERVED_SHARE: 70.0}, {SERVED_SHARE: 65.0}, Verdict.MET, id="already-short-and-no-worse"),
    pytest.param({SERVED_SHARE: 70.0}, {SERVED_SHARE: 59.0}, Verdict.VIOLATED, id="already-short-and-worse"),
    pytest.param({SERVED_SHARE: 99.0}, {SERVED_SHARE: 89.5}, Verdict.MET, id="drop-within-tolerance-of-before"),
    pytest.param({SERVED_SHARE: 99.0}, {SERVED_SHARE: 88.5}, Verdict.VIOLATED, id="drop-beyond-tolerance"),
])
def test_judge_is_relative_to_before(before, after, verdict):
    assert judge(SLO, MAX_REGRESSION, {**BEFORE, **before}, {**AFTER, **after}).verdict is verdict


@pytest.mark.parametrize("after, verdict", [
    pytest.param({"itlMs": 41.0}, Verdict.VIOLATED, id="over-target"),
    pytest.param({"itlMs": 39.0}, Verdict.MET, id="under-target"),
    pytest.param({"errorRatePercent": 1.5}, Verdict.VIOLATED, id="errors-over-slo"),
    pytest.param({SERVED_SHARE: 89.0}, Verdict.VIOLATED, id="served-below-100-less-tolerance"),
    pytest.param({SERVED_SHARE: 90.0}, Verdict.MET, id="served-at-the-floor"),
])
def test_judge_without_a_before_window_judges_the_targets_alone(after, verdict):
    assert judge(SLO, MAX_REGRESSION, {}, {**AFTER, **after}).verdict is verdict


START = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = VerifyPolicy(verify_seconds=300, timeout_seconds=3600, min_requests=50, max_regression_percent=10)


@pytest.mark.parametrize("elapsed, requests, expected", [
    pytest.param(299, 1000, Next.WAIT, id="window-not-over"),
    pytest.param(300, 50, Next.JUDGE, id="window-over-enough-requests"),
    pytest.param(300, 49, Next.WAIT, id="too-few-requests-wait"),
    pytest.param(300, None, Next.WAIT, id="requests-unknown-wait"),
    pytest.param(3599, 10, Next.WAIT, id="before-the-deadline"),
    pytest.param(3600, 10, Next.INCONCLUSIVE, id="deadline-too-few"),
    pytest.param(3600, None, Next.INCONCLUSIVE, id="deadline-unknown"),
    pytest.param(3600, 50, Next.JUDGE, id="deadline-enough"),
])
def test_window_state(elapsed, requests, expected):
    assert window_state(POLICY, START, START + timedelta(seconds=elapsed), requests) is expected


@pytest.mark.parametrize("policy, requests, reason, fragments", [
    pytest.param(InconclusivePolicy.KEEP, 12.0, Reason.KEPT_UNVERIFIED, ("served 12 requests", "kept"), id="keep"),
    pytest.param(InconclusivePolicy.ROLL_BACK, None, Reason.VERIFY_INCONCLUSIVE, ("served no requests", "rolled back"),
                 id="roll-back"),
])
def test_inconclusive(policy, requests, reason, fragments):
    got_reason, message = inconclusive(VerifyPolicy(300, 3600, 50, 10, policy), requests, "Prometheus had no data")
    assert got_reason is reason
    for fragment in fragments + ("verifyMinRequests is 50", "Prometheus had no data"):
        assert fragment in message


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"verify_seconds": 0, "timeout_seconds": 60}, "must be >= 1", id="no-window"),
    pytest.param({"verify_seconds": 600, "timeout_seconds": 300}, "shorter than the window", id="timeout-before-window"),
])
def test_verify_policy_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VerifyPolicy(min_requests=1, max_regression_percent=10, **kwargs)


def test_inconclusive_message_in_full():
    policy = VerifyPolicy(300, 3600, 50, 10)
    assert inconclusive(policy, 12.0) == (Reason.KEPT_UNVERIFIED, (
        "production served 12 requests in 3600s after the rollout (spec.apply.verifyMinRequests is 50): kept, as "
        "spec.apply.onInconclusiveVerify is Keep (the setting met the SLO in its trials)"))
    assert inconclusive(VerifyPolicy(300, 3600, 50, 10, InconclusivePolicy.ROLL_BACK), None, "no data") == (
        Reason.VERIFY_INCONCLUSIVE, "production served no requests in 3600s after the rollout (spec.apply.verifyMinRequests "
        "is 50); no data: rolled back, as spec.apply.onInconclusiveVerify is RollBack")


def test_smallest_verify_policy():
    assert VerifyPolicy(verify_seconds=1, timeout_seconds=1, min_requests=1, max_regression_percent=0).timeout_seconds == 1


SLO_TWO = SloTargets(percentile=95, ttft_ms=500, itl_ms=40, max_error_rate_percent=1, headroom_percent=10)


@pytest.mark.parametrize("before, after, verdict, reason", [
    pytest.param(BEFORE, AFTER, Verdict.MET, "p95 itlMs 30 ms; error rate 0%; served 100% of offered requests", id="met"),
    pytest.param({}, {**AFTER, "itlMs": 40.0, "errorRatePercent": 1.0}, Verdict.MET,
                 "p95 itlMs 40 ms; error rate 1%; served 100% of offered requests", id="exactly-at-the-targets"),
    pytest.param({}, {**AFTER, "itlMs": 41.0, "errorRatePercent": 1.5, SERVED_SHARE: 80.0}, Verdict.VIOLATED,
                 "p95 itlMs 41 ms > 40 ms target; error rate 1.5% > 1%; production served 80% of the requests it was "
                 "offered, below 90% (spec.apply.maxRegressionPercent 10%)", id="every-problem-without-before"),
    pytest.param({**BEFORE, "itlMs": 0.5}, {**AFTER, "itlMs": 50.0}, Verdict.VIOLATED,
                 "p95 itlMs 50 ms > 40 ms target, was 0.5 ms", id="worse-than-a-sub-millisecond-before"),
    pytest.param({}, {**AFTER, "itlMs": math.inf}, Verdict.VIOLATED,
                 "p95 itlMs above the highest histogram bucket > 40 ms target", id="inf"),
    pytest.param({**BEFORE, SERVED_SHARE: 99.0}, {**AFTER, SERVED_SHARE: 88.0}, Verdict.VIOLATED,
                 "production served 88% of the requests it was offered (was 99%), below 89% "
                 "(spec.apply.maxRegressionPercent 10%)", id="served-share-with-before"),
    pytest.param({}, {"itlMs": None}, Verdict.UNKNOWN,
                 "itlMs after the change is not measured; error rate after the change is not measured; the share of "
                 "offered requests production served after the change is not measured", id="all-unknown"),
])
def test_judge_reasons(before, after, verdict, reason):
    assert judge(SLO, MAX_REGRESSION, before, after) == VerifyResult(verdict, reason)


def test_an_unmeasured_latency_does_not_hide_the_next():
    result = judge(SLO_TWO, MAX_REGRESSION, {}, {**AFTER, "itlMs": 80.0})
    assert result == VerifyResult(Verdict.VIOLATED, "p95 itlMs 80 ms > 40 ms target")


@pytest.mark.parametrize("before, after, verdict", [
    pytest.param({"itlMs": 100.0}, {"itlMs": 110.0}, Verdict.MET, id="latency-exactly-the-tolerance-worse"),
    pytest.param({"itlMs": 100.0}, {"itlMs": 110.5}, Verdict.VIOLATED, id="latency-beyond-the-tolerance"),
])
def test_latency_regression_tolerance(before, after, verdict):
    assert judge(SLO, MAX_REGRESSION, {**BEFORE, **before}, {**AFTER, **after}).verdict is verdict


@pytest.mark.parametrize("before, after, verdict", [
    pytest.param({"itlMs": 50.0}, {"itlMs": 50.0}, Verdict.MET, id="latency-unchanged"),
    pytest.param({"itlMs": 50.0}, {"itlMs": 50.5}, Verdict.VIOLATED, id="latency-any-worse"),
    pytest.param({"errorRatePercent": 2.0}, {"errorRatePercent": 2.0}, Verdict.MET, id="errors-unchanged"),
    pytest.param({"errorRatePercent": 2.0}, {"errorRatePercent": 2.5}, Verdict.VIOLATED, id="errors-any-worse"),
])
def test_zero_tolerance_allows_no_change_but_no_worse(before, after, verdict):
    assert judge(SLO, 0, {**BEFORE, **before}, {**AFTER, **after}).verdict is verdict


def test_a_before_of_zero_excuses_nothing():
    assert judge(SLO, MAX_REGRESSION, {**BEFORE, "itlMs": 0.0}, {**AFTER, "itlMs": 80.0}) == VerifyResult(
        Verdict.VIOLATED, "p95 itlMs 80 ms > 40 ms target, was 0 ms")
