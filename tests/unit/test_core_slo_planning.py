"""SLO evaluation, settings and planning."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchtune.core import (
    EngineLimits,
    FitVerdict,
    SearchSpace,
    Setting,
    SloTargets,
    Verdict,
    doublings,
    evaluate_slo,
    percent_to_fraction,
    plan_candidates,
)

SLO = SloTargets(percentile=95, ttft_ms=200, e2e_ms=1000, max_error_rate_percent=1, headroom_percent=10)


@pytest.mark.parametrize("metrics, verdict, fragment", [
    pytest.param({"ttftMs": 150, "e2eMs": 800, "errorRatePercent": 0}, Verdict.MET, "p95 TTFT 150 ms <= 180 ms", id="met"),
    pytest.param({"ttftMs": 190, "e2eMs": 800, "errorRatePercent": 0}, Verdict.VIOLATED, "190 ms > 180 ms", id="inside-headroom-violates"),
    pytest.param({"ttftMs": 180, "e2eMs": 900, "errorRatePercent": 1}, Verdict.MET, "", id="exactly-at-limit"),
    pytest.param({"ttftMs": 150, "errorRatePercent": 0}, Verdict.UNKNOWN, "E2E latency is not measured", id="missing"),
    pytest.param({"ttftMs": math.nan, "e2eMs": 800, "errorRatePercent": 0}, Verdict.UNKNOWN, "not measured", id="nan"),
    pytest.param({"ttftMs": math.inf, "e2eMs": 800, "errorRatePercent": 0}, Verdict.UNKNOWN, "not measured", id="inf"),
    pytest.param({"ttftMs": "fast", "e2eMs": 800, "errorRatePercent": 0}, Verdict.UNKNOWN, "not measured", id="garbage"),
    pytest.param({"ttftMs": 150, "e2eMs": 800}, Verdict.UNKNOWN, "error rate is not measured", id="no-error-rate"),
    pytest.param({"ttftMs": 150, "e2eMs": 800, "errorRatePercent": 5}, Verdict.VIOLATED, "error rate 5% > 1%", id="errors"),
    pytest.param({"ttftMs": 500, "errorRatePercent": 0}, Verdict.VIOLATED, "500 ms > 180", id="violated-beats-unknown"),
    pytest.param({}, Verdict.UNKNOWN, "", id="empty"),
])
def test_evaluate_slo(metrics, verdict, fragment):
    result = evaluate_slo(metrics, SLO)
    assert result.verdict is verdict
    assert fragment in result.reason


def test_no_target_is_never_met():
    assert evaluate_slo({"errorRatePercent": 0}, SloTargets()).verdict is Verdict.UNKNOWN


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["ttftMs", "e2eMs", "itlMs", "errorRatePercent"]),
                       st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3))))
def test_met_only_on_finite_values_within_limits(metrics):
    result = evaluate_slo(metrics, SLO)
    if result.verdict is Verdict.MET:
        for key, target in (("ttftMs", 200), ("e2eMs", 1000)):
            value = float(metrics[key])
            assert math.isfinite(value) and value <= target * 0.9
        assert float(metrics["errorRatePercent"]) <= 1


def test_setting_args_label_and_status():
    s = Setting(64, 90, 8192)
    assert s.as_args() == ["--max-num-seqs", "64", "--gpu-memory-utilization", "0.90", "--max-num-batched-tokens", "8192"]
    assert s.label() == "seqs=64 gmu=90% mbt=8192"
    assert Setting.from_status(s.to_status()) == s
    assert Setting(8, 95).label() == "seqs=8 gmu=95%"
    assert sorted([Setting(8, 95), Setting(16, 90), Setting(8, 90, 2048), Setting(4, 90)]) == [
        Setting(4, 90), Setting(16, 90), Setting(8, 90, 2048), Setting(8, 95)]
    assert percent_to_fraction(100) == "1.00" and percent_to_fraction(5) == "0.05"
    with pytest.raises(ValueError, match="max_num_seqs 0"):
        Setting(0, 90)


@pytest.mark.parametrize("lo, hi, expected", [
    pytest.param(1, 8, (1, 2, 4, 8), id="powers"),
    pytest.param(3, 20, (3, 6, 12), id="max-not-a-doubling"),
    pytest.param(5, 5, (5,), id="single"),
])
def test_doublings(lo, hi, expected):
    assert doublings(lo, hi) == expected


def test_plan_prunes_vllm_invariants_with_vllm_messages():
    plan = plan_candidates(SearchSpace((64, 128, 256), (90,), (128, 2048)), EngineLimits(max_model_len=4096, chunked_prefill=False))
    reasons = {p.setting: p.reason for p in plan.pruned}
    assert "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)." in reasons[Setting(256, 90, 128)]
    assert "max_num_batched_tokens (2048) is smaller than max_model_len (4096)" in reasons[Setting(64, 90, 2048)]
    assert plan.candidates == ()
    assert plan.error and "no candidate setting is left after 6 were pruned" in plan.error


def test_plan_uses_target_mbt_when_not_searched_and_fit_hook():
    fits = lambda s: FitVerdict(False, "KV cache too small") if s.max_num_seqs > 128 else FitVerdict(None if s.max_num_seqs == 128 else True, "estimate")  # noqa: E731
    plan = plan_candidates(SearchSpace((64, 128, 256, 512), (90, 95)), EngineLimits(max_num_batched_tokens=300), fits)
    assert [s.label() for s in plan.candidates] == ["seqs=64 gmu=90%", "seqs=128 gmu=90%", "seqs=64 gmu=95%", "seqs=128 gmu=95%"]
    reasons = {p.setting.max_num_seqs: p.reason for p in plan.pruned}
    assert "must be greater than or equal to max_num_seqs (512)" in reasons[512]
    assert "does not fit in GPU memory: KV cache too small" in reasons[256]
    assert any("memory fit unknown for 2" in n for n in plan.notes)
    assert plan.error is None


def test_engine_limits_from_flags():
    assert EngineLimits.from_flags({"no-enable-chunked-prefill": None, "max-model-len": "8192"}) == EngineLimits(8192, False, None)
    assert EngineLimits.from_flags({"enable-chunked-prefill": "false"}).chunked_prefill is False
    assert EngineLimits.from_flags({"max-num-batched-tokens": "2048"}).max_num_batched_tokens == 2048
