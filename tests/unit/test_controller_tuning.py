"""The reconcile's pure vocabulary: verify verdicts, step results, trial outcomes, load bounds."""

from __future__ import annotations

import pytest

from batchtune.api import parse_spec
from batchtune.controller import tuning

SPEC = parse_spec({
    "targetRef": {"name": "llm"},
    "searchSpace": {"maxNumSeqs": {"values": [8, 16, 32]}},
    "slo": {"percentile": "P95", "interTokenLatencyMilliseconds": 40, "maxErrorRatePercent": 1,
            "headroomPercent": 10},
    "prometheus": {"url": "http://127.0.0.1:9090"},
    "apply": {"maxRegressionPercent": 10},
})
BEFORE = {"itlMs": 48.8, "outputThroughput": 100.0, "errorRatePercent": 0.0}


@pytest.mark.parametrize("after,verdict", [
    pytest.param({"itlMs": 49.0, "outputThroughput": 102.0, "errorRatePercent": 0.0}, "Met",
                 id="same-bucket-above-target-is-not-a-regression"),
    pytest.param({"itlMs": 30.0, "outputThroughput": 100.0, "errorRatePercent": 0.0}, "Met", id="better"),
    pytest.param({"itlMs": 80.0, "outputThroughput": 100.0, "errorRatePercent": 0.0}, "Violated",
                 id="latency-worse-and-over-target"),
    pytest.param({"itlMs": 30.0, "outputThroughput": 80.0, "errorRatePercent": 0.0, "waitingRequests": 3.0},
                 "Violated", id="throughput-dropped-while-queueing"),
    pytest.param({"itlMs": 30.0, "outputThroughput": 80.0, "errorRatePercent": 0.0}, "Violated",
                 id="throughput-dropped-queue-unknown"),
    pytest.param({"itlMs": 30.0, "outputThroughput": 80.0, "errorRatePercent": 0.0, "waitingRequests": 0.0},
                 "Met", id="throughput-dropped-with-an-empty-queue-is-less-traffic"),
    pytest.param({"itlMs": 30.0, "outputThroughput": 100.0, "errorRatePercent": 5.0}, "Violated", id="errors"),
    pytest.param({"itlMs": None, "outputThroughput": 100.0, "errorRatePercent": 0.0}, "Unknown",
                 id="latency-missing"),
    pytest.param({"itlMs": float("nan"), "outputThroughput": 100.0, "errorRatePercent": 0.0}, "Unknown",
                 id="latency-nan"),
    pytest.param({"itlMs": 30.0, "outputThroughput": None, "errorRatePercent": 0.0}, "Unknown",
                 id="throughput-missing"),
])
def test_verify_verdict(after, verdict):
    assert tuning.verify_verdict(SPEC, BEFORE, after)[0] == verdict


def test_verify_without_a_before_window_judges_the_target_alone():
    assert tuning.verify_verdict(SPEC, {}, {"itlMs": 41.0, "errorRatePercent": 0.0})[0] == "Violated"
    assert tuning.verify_verdict(SPEC, {}, {"itlMs": 39.0, "errorRatePercent": 0.0})[0] == "Met"


def test_client_percentiles_decide_and_histograms_are_kept():
    measured = tuning.Measurement({"itlMs": 48.85, "requestThroughput": 2.0, "outputThroughput": 146.0})
    result = tuning.step_result(measured, {"completed": 99, "failed": 1, "p95_itl_ms": 28.7,
                                           "request_throughput": 2.0}, 95)
    metrics = result["metrics"]
    assert metrics["itlMs"] == 28.7 and metrics["itlHistogramMs"] == 48.85
    assert metrics["errorRatePercent"] == pytest.approx(1.0)
    assert "itlHistogramMs" in result["crossCheck"]


def test_without_a_summary_the_error_rate_stays_unknown():
    result = tuning.step_result(tuning.Measurement({"itlMs": 20.0, "requestThroughput": 1.0,
                                                    "outputThroughput": 9.0}), None, 95)
    assert "errorRatePercent" not in result["metrics"]
    step = {"load": 4, "results": [result]}
    tuning.close_step(SPEC, step)
    assert step["verdict"] == "Unknown"


def test_capacity_comes_from_the_highest_passing_load():
    steps = [
        {"load": 8, "verdict": "Met", "margin": 0.5, "metrics": {"requestThroughput": 4.0}},
        {"load": 32, "verdict": "Violated", "margin": -0.2, "metrics": {"requestThroughput": 9.0}},
        {"load": 16, "verdict": "Met", "margin": 0.05, "metrics": {"requestThroughput": 7.0}},
    ]
    outcome = tuning.trial_outcome(parse_spec({**SPEC.model_dump(by_alias=True, exclude_none=True),
                                               "objective": {"type": "SloCapacity"}}), steps)
    assert outcome.verdict == "Met"
    assert outcome.metrics["sloCapacity"] == 7.0 and outcome.metrics["sloCapacityLoad"] == 16


def test_no_passing_load_is_violated_not_unknown():
    steps = [{"load": 4, "verdict": "Violated", "margin": -0.5, "metrics": {"requestThroughput": 1.0}}]
    assert tuning.trial_outcome(SPEC, steps).verdict == "Violated"


def test_closed_loop_ceiling_is_twice_the_batch():
    assert tuning.capacity_ceiling(SPEC, {"setting": {"maxNumSeqs": 32}}) == 64


def test_memory_pruned_settings_teach_the_strategy_without_spending_trials():
    spec = parse_spec({
        "targetRef": {"name": "llm"},
        "searchSpace": {"maxNumSeqs": {"values": [4, 8, 16]}, "gpuMemoryUtilizationPercent": [90, 95]},
        "strategy": {"type": "Adaptive", "maxTrials": 3},
        "slo": {"interTokenLatencyMilliseconds": 50},
        "prometheus": {"url": "http://127.0.0.1:9090"},
    })
    pruned = [{"setting": {"maxNumSeqs": s, "gpuMemoryUtilizationPercent": 90},
               "reason": "does not fit in GPU memory: ValueError: No available memory for the cache blocks."}
              for s in (8, 16)]
    met = {"index": 0, "name": "t-0", "state": "Done", "verdict": "Met",
           "setting": {"maxNumSeqs": 4, "gpuMemoryUtilizationPercent": 90},
           "metrics": {"requestThroughput": 2.0, "sloCapacity": 2.0, "kvCacheUsagePercent": 30.0,
                       "preemptionsPerSecond": 0.0, "ttftMs": 100.0, "itlMs": 20.0, "errorRatePercent": 0.0}}
    plan = {"engineLimits": {"chunkedPrefill": True}}
    nxt = tuning.next_setting(spec, plan, {}, [met], pruned)
    # The gmu-90% column ends where memory ran out, not at the SLO: more memory is worth a trial.
    assert nxt is not None and nxt["gpuMemoryUtilizationPercent"] == 95
    first = tuning.next_setting(spec, plan, {}, [], pruned)
    assert first not in [p["setting"] for p in pruned]


@pytest.mark.parametrize("objective", ["SloCapacity", "OutputThroughput"])
def test_trial_metrics_carry_the_peak_kv_usage_and_preemptions_over_all_steps(objective):
    # The capacity step's own KV usage is low; the failing step above it is where the cache binds.
    steps = [
        {"load": 8, "verdict": "Met", "metrics": {"requestThroughput": 4.0, "kvCacheUsagePercent": 40.0,
                                                  "kvCacheUsageMaxPercent": 55.0, "preemptionsPerSecond": 0.0}},
        {"load": 16, "verdict": "Violated", "metrics": {"requestThroughput": 7.0, "kvCacheUsagePercent": 88.0,
                                                        "kvCacheUsageMaxPercent": 100.0, "preemptionsPerSecond": 1.5}},
        {"load": 12, "verdict": "Met", "metrics": {"requestThroughput": 6.0, "kvCacheUsagePercent": 60.0,
                                                   "preemptionsPerSecond": 0.0}},
    ]
    spec = parse_spec({**SPEC.model_dump(by_alias=True, exclude_none=True), "objective": {"type": objective}})
    outcome = tuning.trial_outcome(spec, steps)
    assert outcome.metrics["kvCacheUsagePeakPercent"] == 100.0
    assert outcome.metrics["preemptionsPeakPerSecond"] == 1.5
    if objective == "SloCapacity":
        assert outcome.metrics["kvCacheUsagePercent"] == 60.0 and outcome.metrics["sloCapacityLoad"] == 12


def test_production_selector_escapes_pod_names_for_regex_and_promql():
    sel = tuning.production_selector(SPEC, 'ns"x', ["llm-1.a", "llm-2"])
    assert sel == '{namespace="ns\\"x",pod=~"llm\\\\-1\\\\.a|llm\\\\-2"}'
    assert tuning.production_selector(SPEC, "ns", []).endswith('pod=~"^$"}')
