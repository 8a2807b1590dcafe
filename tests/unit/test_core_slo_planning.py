"""SLO evaluation, settings and planning."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchtune.api.models import SloSpec
from batchtune.core import (
    EngineLimits,
    FitVerdict,
    SearchSpace,
    Setting,
    SloTargets,
    Verdict,
    evaluate_slo,
    percent_to_fraction,
    plan_candidates,
)
from batchtune.core.planning import doublings
from batchtune.core.slo import MIN_SAMPLES
from batchtune.core.vocabulary import Reason
from batchtune.engines import VLLM

SLO = SloTargets(percentile=95, ttft_ms=200, e2e_ms=1000, max_error_rate_percent=1, headroom_percent=10)
OK = {"ttftMs": 150, "e2eMs": 800, "errorRatePercent": 0}


@pytest.mark.parametrize("metrics, verdict, fragment", [
    pytest.param(OK, Verdict.MET, "p95 TTFT 150 ms <= 180 ms", id="met"),
    pytest.param({"ttftMs": 190, "e2eMs": 800, "errorRatePercent": 0}, Verdict.VIOLATED, "190 ms > 180 ms", id="inside-headroom-violates"),
    pytest.param({"ttftMs": 180, "e2eMs": 900, "errorRatePercent": 1}, Verdict.MET, "", id="exactly-at-limit"),
    pytest.param({"ttftMs": 150, "errorRatePercent": 0}, Verdict.UNKNOWN, "E2E latency is not measured", id="missing"),
    pytest.param({"ttftMs": math.nan, "e2eMs": 800, "errorRatePercent": 0}, Verdict.UNKNOWN, "not measured", id="nan"),
    pytest.param({"ttftMs": math.inf, "e2eMs": 800, "errorRatePercent": 0}, Verdict.VIOLATED, "above the highest histogram bucket",
                 id="inf-is-above-the-last-bucket"),
    pytest.param({"ttftMs": -math.inf, "e2eMs": 800, "errorRatePercent": 0}, Verdict.UNKNOWN, "not measured", id="minus-inf"),
    pytest.param({"ttftMs": "fast", "e2eMs": 800, "errorRatePercent": 0}, Verdict.UNKNOWN, "not measured", id="garbage"),
    pytest.param({"ttftMs": 150, "e2eMs": 800}, Verdict.UNKNOWN, "error rate is not measured", id="no-error-rate"),
    pytest.param({"ttftMs": 150, "e2eMs": 800, "errorRatePercent": math.inf}, Verdict.UNKNOWN, "error rate is not measured", id="inf-error-rate"),
    pytest.param({"ttftMs": 150, "e2eMs": 800, "errorRatePercent": 5}, Verdict.VIOLATED, "error rate 5% > 1%", id="errors"),
    pytest.param({"ttftMs": 500, "errorRatePercent": 0}, Verdict.VIOLATED, "500 ms > 180", id="violated-beats-unknown"),
    pytest.param({}, Verdict.UNKNOWN, "", id="empty"),
])
def test_evaluate_slo(metrics, verdict, fragment):
    result = evaluate_slo(metrics, SLO)
    assert result.verdict is verdict
    assert fragment in result.reason


@pytest.mark.parametrize("extra, verdict, fragment", [
    pytest.param({"samples": MIN_SAMPLES}, Verdict.MET, "", id="enough-samples"),
    pytest.param({"samples": MIN_SAMPLES - 1}, Verdict.UNKNOWN, f"only {MIN_SAMPLES - 1} requests", id="too-few-samples"),
    pytest.param({"samples": 0}, Verdict.UNKNOWN, "only 0 requests", id="no-samples"),
    pytest.param({"samples": 5, "ttftMs": 500}, Verdict.VIOLATED, "500 ms > 180", id="few-samples-but-a-breach"),
    pytest.param({"samples": math.nan}, Verdict.MET, "", id="samples-unknown-is-not-counted"),
    pytest.param({"waitingGrowth": 2.0, "waitingRequests": 0.0}, Verdict.MET, "", id="queue-growth-at-the-floor"),
    pytest.param({"waitingGrowth": 2.5, "waitingRequests": 0.0}, Verdict.VIOLATED, "the queue grew by 2.5", id="queue-grew"),
    pytest.param({"waitingGrowth": 9.0, "waitingRequests": 20.0}, Verdict.MET, "", id="growth-within-half-the-mean"),
    pytest.param({"waitingGrowth": 11.0, "waitingRequests": 20.0}, Verdict.VIOLATED, "the queue grew by 11", id="growth-above-half-the-mean"),
    pytest.param({"waitingGrowth": 5.0}, Verdict.VIOLATED, "the queue grew by 5", id="growth-mean-unknown"),
    pytest.param({"waitingGrowth": -30.0, "waitingRequests": 10.0}, Verdict.MET, "", id="queue-drained"),
    pytest.param({"waitingGrowth": math.nan, "waitingRequests": 10.0}, Verdict.MET, "", id="growth-unknown"),
])
def test_evaluate_slo_samples_and_steady_state(extra, verdict, fragment):
    result = evaluate_slo({**OK, **extra}, SLO)
    assert result.verdict is verdict
    assert fragment in result.reason


@pytest.mark.parametrize("metrics, verdict, reason", [
    pytest.param({"ttftMs": 150, "e2eMs": 800, "errorRatePercent": 0}, Verdict.MET,
                 "p95 TTFT 150 ms <= 180 ms (200 ms target less 10% headroom); "
                 "p95 E2E latency 800 ms <= 900 ms (1000 ms target less 10% headroom); error rate 0% <= 1%", id="met"),
    pytest.param({"ttftMs": math.nan, "e2eMs": 800, "errorRatePercent": math.inf}, Verdict.UNKNOWN,
                 "p95 TTFT is not measured (ttftMs=nan); error rate is not measured (errorRatePercent=inf)", id="unknown-quotes-the-value"),
    pytest.param({"ttftMs": math.nan, "e2eMs": 5000, "errorRatePercent": 0}, Verdict.VIOLATED,
                 "p95 E2E latency 5000 ms > 900 ms (1000 ms target less 10% headroom); p95 TTFT is not measured (ttftMs=nan)",
                 id="an-unmeasured-target-does-not-hide-the-next"),
    pytest.param({"ttftMs": 150, "e2eMs": 800, "errorRatePercent": 0, "waitingGrowth": 5.0, "waitingRequests": 0.0}, Verdict.VIOLATED,
                 "the queue grew by 5 requests through the window (mean 0 waiting): "
                 "the load exceeds what the setting serves, so no latency measured here holds", id="queue-grew"),
])
def test_evaluate_slo_reasons(metrics, verdict, reason):
    result = evaluate_slo(metrics, SLO)
    assert (result.verdict, result.reason) == (verdict, reason)


def test_reason_without_headroom_names_the_bare_target():
    result = evaluate_slo({"itlMs": 30, "errorRatePercent": 0}, SloTargets(itl_ms=40, headroom_percent=0))
    assert result.reason == "p95 ITL 30 ms <= 40 ms (40 ms target); error rate 0% <= 1%"


@pytest.mark.parametrize("value, verdict", [
    pytest.param(0, Verdict.MET, id="zero-is-a-measurement"),
    pytest.param(0.5, Verdict.MET, id="below-one-ms"),
    pytest.param(-1, Verdict.UNKNOWN, id="negative-is-junk"),
    pytest.param(True, Verdict.UNKNOWN, id="a-bool-is-no-number"),
])
def test_small_and_junk_latencies(value, verdict):
    assert evaluate_slo({**OK, "ttftMs": value}, SLO).verdict is verdict


def test_a_bool_error_rate_is_not_measured():
    assert evaluate_slo({**OK, "errorRatePercent": False}, SLO).verdict is Verdict.UNKNOWN


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"percentile": 42, "ttft_ms": 200}, "percentile 42 is not one of 50, 90, 95, 99", id="percentile"),
    pytest.param({"headroom_percent": 100, "ttft_ms": 200}, "headroom_percent 100 is outside 0..99", id="headroom-100"),
    pytest.param({"headroom_percent": -1, "ttft_ms": 200}, "headroom_percent -1 is outside 0..99", id="headroom-negative"),
    pytest.param({"ttft_ms": 0}, "ttft_ms 0 must be > 0", id="ttft-zero"),
    pytest.param({"itl_ms": -5}, "itl_ms -5 must be > 0", id="itl-negative"),
    pytest.param({"e2e_ms": 0}, "e2e_ms 0 must be > 0", id="e2e-zero"),
])
def test_bad_targets_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        SloTargets(**kwargs)
    assert str(err.value) == message


def test_smallest_valid_targets():
    slo = SloTargets(ttft_ms=1, itl_ms=1, e2e_ms=1, headroom_percent=99)
    assert slo.latency_targets() == {"ttftMs": 1, "itlMs": 1, "e2eMs": 1}


def test_the_api_model_converts_every_field():
    spec = SloSpec(percentile="P99", ttftMilliseconds=300, interTokenLatencyMilliseconds=40, e2eLatencyMilliseconds=9000,
                   maxErrorRatePercent=3, headroomPercent=20)
    assert spec.core() == SloTargets(percentile=99, ttft_ms=300, itl_ms=40, e2e_ms=9000,
                                                    max_error_rate_percent=3, headroom_percent=20)
    assert SloSpec(e2eLatencyMilliseconds=9000).core() == SloTargets(e2e_ms=9000)


def test_min_samples_is_configurable():
    assert evaluate_slo({**OK, "samples": 5}, SloTargets(ttft_ms=200, e2e_ms=1000, min_samples=5)).verdict is Verdict.MET
    assert evaluate_slo({**OK, "samples": 4}, SloTargets(ttft_ms=200, e2e_ms=1000, min_samples=5)).verdict is Verdict.UNKNOWN


def test_no_target_is_never_met():
    result = evaluate_slo({"errorRatePercent": 0}, SloTargets())
    assert (result.verdict, result.reason) == (Verdict.UNKNOWN, "no latency target is set, so the SLO cannot be met")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["ttftMs", "e2eMs", "itlMs", "errorRatePercent", "samples", "waitingGrowth"]),
                       st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3))))
def test_met_only_on_finite_values_within_limits(metrics):
    result = evaluate_slo(metrics, SLO)
    if result.verdict is Verdict.MET:
        for key, target in (("ttftMs", 200), ("e2eMs", 1000)):
            value = float(metrics[key])
            assert math.isfinite(value) and value <= target * 0.9
        assert float(metrics["errorRatePercent"]) <= 1
        samples = metrics.get("samples")
        assert not isinstance(samples, float) or not math.isfinite(samples) or samples >= MIN_SAMPLES


def test_setting_args_label_and_status():
    s = Setting(64, 90, 8192)
    assert VLLM.setting_args(s) == ["--max-num-seqs", "64", "--gpu-memory-utilization", "0.90", "--max-num-batched-tokens", "8192"]
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


def _invariant(limits: EngineLimits):
    return lambda s: VLLM.invariant_violation(s, limits)


def test_plan_prunes_vllm_invariants_with_vllm_messages():
    limits = EngineLimits(max_model_len=4096, chunked_prefill=False)
    plan = plan_candidates(SearchSpace((64, 128, 256), (90,), (128, 2048)), _invariant(limits), limits=limits)
    pruned = {p.setting: p for p in plan.pruned}
    assert {p.reason for p in plan.pruned} == {Reason.ENGINE_INVARIANT}
    assert "max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)." in pruned[Setting(256, 90, 128)].message
    assert "max_num_batched_tokens (2048) is smaller than max_model_len (4096)" in pruned[Setting(64, 90, 2048)].message
    assert plan.candidates == ()
    assert plan.error and "no candidate setting is left after 6 were pruned" in plan.error


def test_plan_uses_target_mbt_when_not_searched_and_fit_hook():
    def fits(s):
        if s.max_num_seqs > 128:
            return FitVerdict(False, "KV cache too small", Reason.KV_CACHE_TOO_SMALL if s.gpu_memory_utilization_percent == 90
                              else Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH)
        return FitVerdict(None if s.max_num_seqs == 128 else True, "estimate")

    limits = EngineLimits(max_num_batched_tokens=300)
    plan = plan_candidates(SearchSpace((64, 128, 256, 512), (90, 95)), _invariant(limits), fits, limits)
    assert [s.label() for s in plan.candidates] == ["seqs=64 gmu=90%", "seqs=128 gmu=90%", "seqs=64 gmu=95%", "seqs=128 gmu=95%"]
    pruned = {(p.setting.max_num_seqs, p.setting.gpu_memory_utilization_percent): p for p in plan.pruned}
    assert pruned[512, 90].reason is Reason.ENGINE_INVARIANT and pruned[512, 90].memory_reason is None
    assert "must be greater than or equal to max_num_seqs (512)" in pruned[512, 90].message
    assert pruned[256, 90].reason is Reason.DOES_NOT_FIT_MEMORY
    assert "does not fit in GPU memory: KV cache too small" in pruned[256, 90].message
    assert pruned[256, 90].memory_reason is Reason.KV_CACHE_TOO_SMALL
    assert pruned[256, 95].memory_reason is Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH
    assert any("memory fit unknown for 2" in n for n in plan.notes)
    assert not any("neither searched nor set" in n for n in plan.notes)
    assert plan.error is None


def test_plan_memory_reason_defaults_to_kv_cache_too_small():
    plan = plan_candidates(SearchSpace((8,)), fits=lambda s: FitVerdict(False, "too big"))
    assert [(p.reason, p.memory_reason) for p in plan.pruned] == [(Reason.DOES_NOT_FIT_MEMORY, Reason.KV_CACHE_TOO_SMALL)]


def test_plan_notes_without_mbt_or_estimator():
    plan = plan_candidates(SearchSpace((8, 16)))
    assert len(plan.candidates) == 2 and plan.pruned == ()
    assert any("neither searched nor set" in n for n in plan.notes)
    assert any("no memory-fit estimator" in n for n in plan.notes)


def _limits(*flags: str) -> EngineLimits:
    return VLLM.limits(VLLM.read({"name": "v", "command": ["vllm", "serve", "m", *flags]}).flags)


@pytest.mark.parametrize("flags, expected", [
    pytest.param(("--no-enable-chunked-prefill", "--max-model-len", "8192"), EngineLimits(8192, False, None), id="no-chunked"),
    pytest.param(("--enable-chunked-prefill=false",), EngineLimits(None, False, None), id="chunked-false"),
    pytest.param(("--enable-chunked-prefill",), EngineLimits(None, True, None), id="chunked-switch"),
    pytest.param(("--max-num-batched-tokens", "2048"), EngineLimits(None, True, 2048), id="mbt"),
    pytest.param((), EngineLimits(None, True, None), id="defaults"),
])
def test_engine_limits_from_the_target(flags, expected):
    assert _limits(*flags) == expected


@pytest.mark.parametrize("setting, limits, fragment", [
    pytest.param(Setting(64, 90, 32), EngineLimits(), "must be greater than or equal to max_num_seqs (64)", id="mbt-below-seqs"),
    pytest.param(Setting(64, 90), EngineLimits(max_num_batched_tokens=32), "(32) must be greater", id="targets-mbt"),
    pytest.param(Setting(64, 90, 2048), EngineLimits(max_model_len=4096, chunked_prefill=False), "smaller than max_model_len",
                 id="no-chunking-mbt-below-model-len"),
    pytest.param(Setting(64, 90, 2048), EngineLimits(max_model_len=4096, chunked_prefill=True), None, id="chunking-allows-it"),
    pytest.param(Setting(64, 90), EngineLimits(), None, id="mbt-unknown"),
])
def test_vllm_invariant_violation(setting, limits, fragment):
    violation = VLLM.invariant_violation(setting, limits)
    assert (violation is None) if fragment is None else (fragment in violation)
