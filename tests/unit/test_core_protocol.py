"""The trial protocol: the SLO-capacity load search, closing a step over repeats, and the trial's conclusion."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtune.core.objective import Objective
from batchtune.core.protocol import (
    EXTRA_STEPS_WHEN_MISLED,
    MAX_CONFIRMATIONS,
    RESOLUTION,
    CurveLoad,
    Neighbour,
    ProtocolConfig,
    RunResult,
    SearchBounds,
    StepResult,
    TrialDriver,
    bracket_seconds,
    capacity_ceiling,
    capacity_start,
    close_step,
    conclude,
    longer_run,
    neighbours_of,
    next_load,
    next_step,
    production_peak_curve_load,
    search_next,
    search_step_at,
    slo_margin,
    worst_case,
)
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets
from batchtune.core.vocabulary import M, Reason, TrialState, Verdict

SLO = SloTargets(percentile=95, itl_ms=40, max_error_rate_percent=1, headroom_percent=10)
CAPACITY = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=False)
THROUGHPUT = ProtocolConfig(Objective.OUTPUT_THROUGHPUT, SLO, open_loop=False)
GOOD = {M.ITL_MS: 20.0, M.ERROR_RATE_PERCENT: 0.0, M.REQUEST_THROUGHPUT: 4.0, M.OUTPUT_THROUGHPUT: 400.0}


def _step(load: int, margin: float, **metrics: float) -> StepResult:
    verdict = Verdict.MET if margin >= 0 else Verdict.VIOLATED
    return StepResult(load, {M.REQUEST_THROUGHPUT: float(load), **metrics}, verdict, "", margin)


# ---- the load search --------------------------------------------------------------------------


def _run_search(capacity_true: float, start: int, max_steps: int = 8) -> list[StepResult]:
    """Drives the search against a synthetic trial whose margin falls linearly with load."""
    steps: list[StepResult] = []
    bounds = SearchBounds(start=start, highest=4096, max_steps=max_steps)
    while (load := search_next(steps, bounds)) is not None:
        steps.append(_step(load, (capacity_true - load) / capacity_true))
    return steps


def _capacity_load(steps: list[StepResult]) -> int | None:
    found = conclude(steps, CAPACITY).metrics.get(M.SLO_CAPACITY_LOAD)
    return None if found is None else int(found)


@pytest.mark.parametrize("true_capacity, start", [
    pytest.param(100, 16, id="bracket-up"), pytest.param(100, 512, id="bracket-down"),
    pytest.param(37, 37, id="exact-start"), pytest.param(3000, 64, id="far-up"),
])
def test_load_search_brackets_then_interpolates(true_capacity, start):
    steps = _run_search(true_capacity, start)
    found = _capacity_load(steps)
    assert found is not None
    assert found <= true_capacity
    assert found >= 0.85 * true_capacity or len(steps) == 8
    assert len({s.load for s in steps}) == len(steps), "no load is run twice"


def test_load_search_beats_linear_stepping():
    steps = _run_search(200, 16)
    assert len(steps) <= 6  # linear stepping by 16 would take 12 runs


def test_load_search_nothing_passes():
    steps = _run_search(0.5, 8)
    assert _capacity_load(steps) is None
    assert min(s.load for s in steps) == 1


@settings(max_examples=200, deadline=None)
@given(true_capacity=st.integers(1, 2000), start=st.integers(1, 2000))
def test_load_search_never_reports_a_failing_load(true_capacity, start):
    steps = _run_search(true_capacity, start, max_steps=5)
    found = _capacity_load(steps)
    assert found is None or found <= true_capacity
    assert len(steps) <= 5


@pytest.mark.parametrize("steps, expected", [
    pytest.param([], 16, id="start"),
    pytest.param([_step(16, 0.05)], None, id="pass-within-resolution-stops"),
    pytest.param([_step(16, 0.5)], 32, id="pass-extrapolates-to-zero-margin"),
    pytest.param([_step(16, 0.9)], 64, id="growth-capped-at-4x"),
    pytest.param([_step(4096, 0.5)], None, id="highest-reached"),
    pytest.param([_step(16, -math.inf)], 4, id="unmeasured-steps-down-fastest"),
    pytest.param([_step(1, -0.5)], None, id="lowest-fails"),
    pytest.param([_step(16, 0.5), _step(32, -0.5)], 24, id="interpolates-between"),
    pytest.param([_step(16, 0.5), _step(17, -0.5)], None, id="bracket-within-resolution"),
    pytest.param([_step(16, 0.5), _step(8, -0.5)], 18, id="fail-below-a-pass-is-noise"),
])
def test_search_next(steps, expected):
    assert search_next(steps, SearchBounds(start=16, highest=4096)) == expected


def test_search_stops_at_max_steps():
    assert search_next([_step(1, 0.9), _step(2, 0.9)], SearchBounds(start=1, max_steps=2)) is None


# ---- where a trial's search starts and what it stops at ----------------------------------------


@pytest.mark.parametrize("setting, neighbours, config, expected", [
    pytest.param(Setting(32, 90), [], CAPACITY, 16, id="half-the-batch"),
    pytest.param(Setting(1, 90), [], CAPACITY, 1, id="at-least-one"),
    pytest.param(Setting(32, 90), [], ProtocolConfig(Objective.SLO_CAPACITY, SLO, False, first_load=5), 5, id="first-load"),
    pytest.param(Setting(32, 90), [Neighbour(Setting(16, 90), 20)], CAPACITY, 40, id="neighbour-scaled-by-batch"),
    pytest.param(Setting(128, 90), [Neighbour(Setting(16, 90), 20)], CAPACITY, 40, id="scale-capped-at-2x"),
    pytest.param(Setting(4, 90), [Neighbour(Setting(64, 90), 40)], CAPACITY, 20, id="scale-floored-at-half"),
    pytest.param(Setting(32, 90), [Neighbour(Setting(8, 90), 5), Neighbour(Setting(64, 90), 50)], CAPACITY, 25,
                 id="nearest-neighbour"),
    pytest.param(Setting(32, 90), [Neighbour(Setting(16, 90), 600)],
                 ProtocolConfig(Objective.SLO_CAPACITY, SLO, True, first_load=60), 600, id="open-loop-not-scaled"),
])
def test_capacity_start(setting, neighbours, config, expected):
    assert capacity_start(setting, neighbours, config) == expected


def test_open_loop_search_needs_a_first_load():
    with pytest.raises(ValueError, match="first_load"):
        capacity_start(Setting(8, 90), [], ProtocolConfig(Objective.SLO_CAPACITY, SLO, True))


@pytest.mark.parametrize("setting, config, ceiling", [
    pytest.param(Setting(32, 90), CAPACITY, 64, id="closed-loop-twice-the-batch"),
    pytest.param(Setting(1, 90), CAPACITY, 2, id="at-least-two"),
    pytest.param(Setting(32, 90), ProtocolConfig(Objective.SLO_CAPACITY, SLO, True, first_load=60), 10_000_000, id="open-loop"),
])
def test_capacity_ceiling(setting, config, ceiling):
    assert capacity_ceiling(setting, config) == ceiling


@pytest.mark.parametrize("steps, config, expected", [
    pytest.param([], THROUGHPUT, 32, id="fixed-objective-runs-at-the-batch"),
    pytest.param([], ProtocolConfig(Objective.OUTPUT_THROUGHPUT, SLO, False, fixed_load=7), 7, id="fixed-load"),
    pytest.param([_step(32, 0.5)], THROUGHPUT, None, id="fixed-objective-one-step"),
    pytest.param([], CAPACITY, 16, id="capacity-starts-at-half"),
    pytest.param([_step(60, 0.9)], CAPACITY, 64, id="capacity-search-capped-at-the-ceiling"),
])
def test_next_load(steps, config, expected):
    assert next_load(steps, Setting(32, 90), [], config) == expected


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"repeats": 0}, "repeats", id="no-repeats"),
    pytest.param({"max_steps": 0}, "max_steps", id="no-steps"),
    pytest.param({"objective": Objective.OUTPUT_THROUGHPUT, "open_loop": True}, "fixed_load", id="open-loop-fixed-needs-load"),
])
def test_protocol_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProtocolConfig(**({"objective": Objective.SLO_CAPACITY, "slo": SLO, "open_loop": False} | kwargs))


# ---- closing a step -----------------------------------------------------------------------------


@pytest.mark.parametrize("runs, expected", [
    pytest.param([{M.ITL_MS: 20.0}, {M.ITL_MS: 30.0}], {M.ITL_MS: 30.0}, id="highest-latency"),
    pytest.param([{M.REQUEST_THROUGHPUT: 4.0}, {M.REQUEST_THROUGHPUT: 3.0}], {M.REQUEST_THROUGHPUT: 3.0}, id="lowest-throughput"),
    pytest.param([{M.SAMPLES: 100.0}, {M.SAMPLES: 10.0}], {M.SAMPLES: 10.0}, id="fewest-samples"),
    pytest.param([{M.GPU_UTIL_PERCENT: 50.0}, {M.GPU_UTIL_PERCENT: 70.0}], {M.GPU_UTIL_PERCENT: 60.0}, id="mean-of-the-rest"),
    pytest.param([{M.ITL_MS: 20.0}, {M.ITL_MS: math.inf}], {M.ITL_MS: math.inf}, id="inf-latency-stays"),
    pytest.param([{M.ITL_MS: 20.0}, {}], {M.ITL_MS: 20.0}, id="latency-missing-in-one-repeat"),
    pytest.param([{M.ERROR_RATE_PERCENT: 0.0}, {}], {}, id="error-rate-missing-in-one-repeat-is-unknown"),
    pytest.param([{M.ERROR_RATE_PERCENT: 0.0}, {M.ERROR_RATE_PERCENT: 2.0}], {M.ERROR_RATE_PERCENT: 2.0}, id="highest-error-rate"),
    pytest.param([{M.REQUEST_THROUGHPUT: math.nan}, {M.REQUEST_THROUGHPUT: 3.0}], {M.REQUEST_THROUGHPUT: 3.0}, id="nan-ignored"),
    pytest.param([{M.GPU_UTIL_PERCENT: math.inf}], {}, id="non-finite-mean-dropped"),
])
def test_worst_case(runs, expected):
    assert worst_case(runs) == expected


@pytest.mark.parametrize("runs, verdict, fragment", [
    pytest.param([GOOD], Verdict.MET, "p95 ITL 20 ms <= 36 ms", id="one-good-run"),
    pytest.param([GOOD, {**GOOD, M.ITL_MS: 38.0}], Verdict.VIOLATED, "38 ms > 36 ms", id="worst-repeat-decides"),
    pytest.param([GOOD, {**GOOD, M.ITL_MS: math.inf}], Verdict.VIOLATED, "above the highest histogram bucket",
                 id="inf-repeat-violates"),
    pytest.param([GOOD, {k: v for k, v in GOOD.items() if k != M.ERROR_RATE_PERCENT}], Verdict.UNKNOWN,
                 "error rate is not measured", id="repeat-without-error-rate"),
    pytest.param([{k: v for k, v in GOOD.items() if k != M.ERROR_RATE_PERCENT}], Verdict.UNKNOWN,
                 "error rate is not measured", id="no-summary-no-error-rate"),
    pytest.param([{**GOOD, M.SAMPLES: 5.0}], Verdict.UNKNOWN, "only 5 requests", id="too-few-samples"),
    pytest.param([{**GOOD, M.WAITING_GROWTH: 10.0, M.WAITING_REQUESTS: 4.0}], Verdict.VIOLATED, "queue grew", id="not-steady"),
])
def test_close_step(runs, verdict, fragment):
    step = close_step(8, [RunResult(r) for r in runs], CAPACITY)
    assert step.load == 8 and step.verdict is verdict and step.passed is (verdict is Verdict.MET)
    assert fragment in step.verdict_reason


def test_close_step_margin_and_cross_check():
    step = close_step(8, [RunResult(GOOD), RunResult({**GOOD, M.ITL_MS: 27.0}, "itlMs: apart")], CAPACITY)
    assert step.margin == pytest.approx((36 - 27) / 36, abs=1e-4)
    assert step.cross_check == "itlMs: apart"
    assert close_step(8, [RunResult({M.ERROR_RATE_PERCENT: 0.0})], CAPACITY).margin == -math.inf
    with pytest.raises(ValueError, match="no run"):
        close_step(8, [], CAPACITY)


# ---- the trial's conclusion ----------------------------------------------------------------------


def _closed(load: int, verdict: Verdict, margin: float = 0.0, **metrics: float) -> StepResult:
    return StepResult(load, metrics, verdict, f"{verdict} at {load}", margin)


def test_capacity_comes_from_the_highest_passing_load():
    steps = [
        _closed(8, Verdict.MET, 0.5, requestThroughput=4.0),
        _closed(32, Verdict.VIOLATED, -0.2, requestThroughput=9.0),
        _closed(16, Verdict.MET, 0.05, requestThroughput=7.0),
    ]
    conclusion = conclude(steps, CAPACITY)
    assert conclusion.verdict is Verdict.MET and conclusion.reason is Reason.MEASURED
    assert conclusion.metrics[M.SLO_CAPACITY] == 7.0 and conclusion.metrics[M.SLO_CAPACITY_LOAD] == 16
    outcome = conclusion.outcome(Objective.SLO_CAPACITY)
    assert outcome.state is TrialState.DONE and outcome.met and outcome.objective == 7.0


def test_an_open_loops_capacity_is_the_rate_it_held_not_the_requests_its_window_saw_finish():
    # Long requests: a window counts whichever happened to finish in it (issue 21's third failure class: mns16's
    # window saw more finish than it was offered, mns32's fewer, and the smaller batch won on that noise).
    open_loop = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=True, first_load=60)
    small = conclude([_step(60, 0.2, requestThroughput=1.3), _step(66, -0.1, requestThroughput=1.2)], open_loop)
    large = conclude([_step(66, 0.1, requestThroughput=0.9), _step(72, -0.1, requestThroughput=1.1)], open_loop)
    assert small.metrics[M.SLO_CAPACITY] == 1.0 and large.metrics[M.SLO_CAPACITY] == 1.1
    assert large.outcome(Objective.SLO_CAPACITY).objective > small.outcome(Objective.SLO_CAPACITY).objective
    # What the window measured is kept beside it, and a trace's speed (no rate of its own) keeps the measurement.
    assert small.metrics[M.REQUEST_THROUGHPUT] == 1.3
    trace = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=True, first_load=100, trace=True)
    assert conclude([_step(100, 0.2, requestThroughput=1.3)], trace).metrics[M.SLO_CAPACITY] == 1.3


@pytest.mark.parametrize("steps, verdict, reason", [
    pytest.param([_closed(4, Verdict.VIOLATED, -0.5, requestThroughput=1.0)], Verdict.VIOLATED, Reason.NO_CAPACITY,
                 id="no-passing-load-is-violated-not-unknown"),
    pytest.param([_closed(4, Verdict.UNKNOWN), _closed(2, Verdict.UNKNOWN)], Verdict.UNKNOWN, Reason.NO_CAPACITY,
                 id="all-unknown-stays-unknown"),
    pytest.param([_closed(4, Verdict.UNKNOWN), _closed(2, Verdict.VIOLATED)], Verdict.VIOLATED, Reason.NO_CAPACITY,
                 id="one-violation-is-enough"),
    pytest.param([], Verdict.UNKNOWN, Reason.NOT_MEASURED, id="no-step"),
])
def test_conclusion_without_capacity(steps, verdict, reason):
    conclusion = conclude(steps, CAPACITY)
    assert (conclusion.verdict, conclusion.reason) == (verdict, reason)
    assert M.SLO_CAPACITY not in conclusion.metrics


def test_fixed_objective_concludes_on_its_one_step():
    conclusion = conclude([_closed(32, Verdict.MET, 0.3, outputThroughput=500.0, powerWatts=250.0)], THROUGHPUT)
    assert conclusion.verdict is Verdict.MET and conclusion.metrics[M.TOKENS_PER_JOULE] == 2.0
    assert M.SLO_CAPACITY_LOAD not in conclusion.metrics
    assert conclusion.outcome(Objective.OUTPUT_THROUGHPUT).objective == 500.0


@pytest.mark.parametrize("config", [pytest.param(CAPACITY, id="SloCapacity"), pytest.param(THROUGHPUT, id="OutputThroughput")])
def test_trial_metrics_carry_the_peak_kv_usage_and_preemptions_over_all_steps(config):
    # The capacity step's own KV usage is low; the failing step above it is where the cache binds.
    steps = [
        _closed(8, Verdict.MET, 0.5, requestThroughput=4.0, kvCacheUsagePercent=40.0, kvCacheUsageMaxPercent=55.0,
                preemptionsPerSecond=0.0),
        _closed(16, Verdict.VIOLATED, -0.1, requestThroughput=7.0, kvCacheUsagePercent=88.0, kvCacheUsageMaxPercent=100.0,
                preemptionsPerSecond=1.5),
        _closed(12, Verdict.MET, 0.05, requestThroughput=6.0, kvCacheUsagePercent=60.0, preemptionsPerSecond=0.0),
    ]
    metrics = conclude(steps, config).metrics
    assert metrics[M.KV_CACHE_USAGE_PEAK_PERCENT] == 100.0
    assert metrics[M.PREEMPTIONS_PEAK_PER_SECOND] == 1.5
    if config.searches_capacity:
        assert metrics[M.KV_CACHE_USAGE_PERCENT] == 60.0 and metrics[M.SLO_CAPACITY_LOAD] == 12


def test_neighbours_of_finished_trials_with_a_capacity():
    trials = [(Setting(8, 90), {M.SLO_CAPACITY_LOAD: 6.0}), (Setting(16, 90), {}), (Setting(32, 90), {M.SLO_CAPACITY_LOAD: 0.0}),
              (Setting(64, 90), {M.SLO_CAPACITY_LOAD: math.nan})]
    assert neighbours_of(trials) == [Neighbour(Setting(8, 90), 6)]


def test_trial_driver_runs_a_capacity_trial_to_its_end():
    driver = TrialDriver(Setting(32, 90), CAPACITY)
    while (load := driver.next_load()) is not None:
        itl = 10.0 + load  # meets 36 ms up to load 26
        driver.record(load, [RunResult({**GOOD, M.ITL_MS: itl, M.REQUEST_THROUGHPUT: load / 4})])
    conclusion = driver.conclude()
    assert conclusion.verdict is Verdict.MET and 20 <= conclusion.metrics[M.SLO_CAPACITY_LOAD] <= 26
    assert len(driver.steps) <= CAPACITY.max_steps


def test_no_capacity_message_names_the_failure_before_any_cross_check_note():
    steps = [StepResult(2, {}, Verdict.UNKNOWN, "only 9 requests behind the percentiles", None, "itlMs: 33% apart")]
    conclusion = conclude(steps, CAPACITY)
    assert conclusion.message == ("even the lowest load (2) fails: only 9 requests behind the percentiles; "
                                  "itlMs: 33% apart")
    # Selection quotes the message when it rejects the trial: the reader sees why, not just the note.
    assert "only 9 requests" in conclusion.outcome(Objective.SLO_CAPACITY).message


def test_goodput_searches_the_capacity_and_keeps_the_capacity_steps_goodput():
    goodput = ProtocolConfig(Objective.GOODPUT, SLO, open_loop=True, first_load=600)
    assert goodput.searches_capacity
    assert next_load([], Setting(32, 90), [], goodput) == 600
    steps = [_step(600, 0.3, goodput=9.0), _step(900, 0.05, goodput=13.5), _step(1200, -0.2, goodput=15.0)]
    conclusion = conclude(steps, goodput)
    # The highest load that met the SLO decides: the violated step's larger goodput does not count.
    assert conclusion.metrics[M.GOODPUT] == 13.5 and conclusion.metrics[M.SLO_CAPACITY_LOAD] == 900
    assert conclusion.outcome(Objective.GOODPUT).objective == 13.5


def test_goodput_over_repeats_is_the_worst_run():
    combined = worst_case([{M.GOODPUT: 5.0}, {M.GOODPUT: 4.0}])
    assert combined[M.GOODPUT] == 4.0


# ---- a run too thin to judge -------------------------------------------------------------------

THIN_SLO = SloTargets(itl_ms=50, headroom_percent=10)


def thin(samples: float, itl: float = 20.0) -> dict[str, float]:
    return {M.SAMPLES: samples, M.ITL_MS: itl, M.ERROR_RATE_PERCENT: 0.0}


@pytest.mark.parametrize("metrics, seconds, wanted", [
    pytest.param(thin(15), 30, 50, id="from-the-rate-seen-with-a-quarter-to-spare"),
    pytest.param(thin(19), 30, 40, id="one-short"),
    pytest.param(thin(3), 30, 120, id="capped-at-four-windows"),
    pytest.param(thin(0), 30, 120, id="none-finished-goes-to-the-cap"),
    pytest.param(thin(10), 100, 120, id="an-already-longer-window-to-the-cap"),
    pytest.param(thin(20), 30, None, id="enough"),
    pytest.param(thin(5, itl=80), 30, None, id="already-violating-more-requests-cannot-save-it"),
    pytest.param(thin(5), 120, None, id="at-the-cap"),
    pytest.param({M.ITL_MS: 20.0, M.ERROR_RATE_PERCENT: 0.0}, 30, None, id="no-count-no-lengthening"),
    pytest.param(thin(math.nan), 30, None, id="nan-count"),
])
def test_a_thin_run_is_run_longer_from_the_rate_it_saw(metrics, seconds, wanted):
    assert longer_run(metrics, seconds, 30, THIN_SLO) == wanted


# ---- the common curve load ---------------------------------------------------------------------


@pytest.mark.parametrize("peak, replicas, measure, expected, why", [
    pytest.param(10.0, 1, 60, CurveLoad(600, True), "production's peak", id="peak-one-replica"),
    pytest.param(10.0, 4, 60, CurveLoad(150, True), "4 ready replicas", id="peak-per-replica"),
    pytest.param(0.01, 3, 60, CurveLoad(256, False), "fewer than 20 requests", id="too-quiet"),
    pytest.param(0.5, 1, None, CurveLoad(30, True), "production's peak", id="request-count-runs-are-long-enough"),
    pytest.param(None, 1, 60, CurveLoad(256, False), "unknown", id="no-data"),
    pytest.param(0.0, 1, 60, CurveLoad(256, False), "unknown", id="no-requests"),
    pytest.param(math.nan, 1, 60, CurveLoad(256, False), "unknown", id="nan"),
    pytest.param(5.0, 0, 60, CurveLoad(300, True), "1 ready replica", id="no-ready-replica-counts-one"),
])
def test_production_peak_curve_load(peak, replicas, measure, expected, why):
    found = production_peak_curve_load(peak, replicas, 256, measure)
    assert (found.load, found.open_loop) == (expected.load, expected.open_loop)
    assert why in found.source


def test_the_curve_step_comes_after_the_search_and_only_once():
    setting = Setting(16, 90)
    curve = CurveLoad(64, False)
    fixed = ProtocolConfig(Objective.OUTPUT_THROUGHPUT, SLO, open_loop=False, fixed_load=8)
    assert next_step([], setting, [], fixed, curve, False).load == 8  # the search first
    searched = [_step(8, 0.5)]
    assert next_step(searched, setting, [], fixed, curve, False) == next_step(searched, setting, [], fixed, curve, False)
    assert next_step(searched, setting, [], fixed, curve, False).curve
    assert next_step(searched, setting, [], fixed, curve, True) is None  # measured or given up
    assert next_step(searched, setting, [], fixed, None, False) is None  # no curve load: conclude


def test_a_search_step_at_the_curve_load_is_the_curve_point_only_in_the_same_loop():
    closed = ProtocolConfig(Objective.OUTPUT_THROUGHPUT, SLO, open_loop=False, fixed_load=64)
    steps = [_step(64, 0.2)]
    assert search_step_at(steps, CurveLoad(64, False), closed) == 0
    assert next_step(steps, Setting(16, 90), [], closed, CurveLoad(64, False), False) is None
    assert search_step_at(steps, CurveLoad(64, True), closed) is None  # 64/min is not 64 in flight
    assert next_step(steps, Setting(16, 90), [], closed, CurveLoad(64, True), False).curve


def test_a_curve_load_below_one_is_refused():
    with pytest.raises(ValueError, match="curve load"):
        CurveLoad(0, False)


# ---- edges mutation testing found unchecked ------------------------------------------------------


@pytest.mark.parametrize("steps, expected", [
    pytest.param([_step(1, 0.15)], 2, id="a-small-load-grows-by-at-least-one"),
    pytest.param([_step(2, 0.15)], 3, id="two-grows-to-three"),
    pytest.param([_step(16, 0.1)], None, id="pass-exactly-at-the-resolution-stops"),
    pytest.param([_step(16, 1.0)], 64, id="zero-latency-grows-4x"),
    pytest.param([_step(100, -0.1)], 80, id="a-near-miss-steps-down-at-least-to-0.8x"),
    pytest.param([_step(16, 0.1), _step(32, -0.5)], None, id="highest-pass-at-the-resolution-stops"),
    pytest.param([_step(100, 0.5), _step(110, -0.5)], None, id="bracket-exactly-at-the-resolution"),
    pytest.param([_step(5, 0.5), _step(7, -0.5)], 6, id="a-gap-of-two-at-a-small-load-is-probed"),
    pytest.param([_step(100, 0.6), _step(200, -0.2)], 175, id="interpolates-the-margins-root"),
    pytest.param([_step(100, 0.2), _step(150, -10)], 122, id="a-fail-far-past-its-limit-halves-geometrically"),
    pytest.param([_step(600, 0.77), _step(2400, -4.13)], 1200, id="queueing-past-capacity-does-not-pin-the-pass"),
    pytest.param([_step(600, 0.77), _step(2400, -0.9)], 1429, id="a-fail-within-twice-its-limit-interpolates"),
    pytest.param([_step(100, 0.5), StepResult(200, {}, Verdict.VIOLATED, "errors", 0.0)], 150,
                 id="fail-at-zero-margin-bisects"),
    pytest.param([_step(100, 0.5), StepResult(200, {}, Verdict.VIOLATED, "errors", 0.3)], 150,
                 id="fail-with-a-margin-bisects"),
    pytest.param([_step(100, 0.3), StepResult(200, {}, Verdict.VIOLATED, "errors", 0.3)], 150,
                 id="fail-with-the-same-margin-bisects"),
    pytest.param([_step(4096, 0.5), _step(8, -0.5)], None, id="noise-below-a-pass-at-the-ceiling-stops"),
])
def test_search_next_edges(steps, expected):
    got = search_next(steps, SearchBounds(start=16, highest=4096))
    assert got == expected and (got is None or isinstance(got, int))


def test_next_load_follows_the_configs_steps_resolution_and_neighbours():
    two_steps = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=False, max_steps=2)
    assert next_load([_step(4, 0.9), _step(16, 0.9)], Setting(32, 90), [], two_steps) is None
    coarse = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=False, resolution=0.3)
    assert next_load([_step(16, 0.25)], Setting(32, 90), [], coarse) is None
    assert next_load([_step(16, 0.25)], Setting(32, 90), [], CAPACITY) == 21
    assert next_load([], Setting(32, 90), [Neighbour(Setting(32, 90), 10)], CAPACITY) == 10
    assert TrialDriver(Setting(32, 90), CAPACITY, [Neighbour(Setting(32, 90), 10)]).next_load() == 10


def test_one_step_is_a_valid_search():
    assert ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=False, max_steps=1).max_steps == 1


def test_config_and_start_errors_say_what_is_missing():
    with pytest.raises(ValueError) as err:
        ProtocolConfig(Objective.OUTPUT_THROUGHPUT, SLO, open_loop=True)
    assert str(err.value) == "an open loop at a fixed load needs fixed_load (requests per minute)"
    with pytest.raises(ValueError) as err:
        capacity_start(Setting(8, 90), [], ProtocolConfig(Objective.SLO_CAPACITY, SLO, True))
    assert str(err.value) == "an open-loop capacity search needs first_load (requests per minute)"


def test_capacity_start_edges():
    assert capacity_start(Setting(4, 90), [Neighbour(Setting(64, 90), 1)], CAPACITY) == 1
    start = capacity_start(Setting(33, 90), [], CAPACITY)
    assert start == 16 and isinstance(start, int)


def test_worst_case_keeps_every_other_figure():
    runs = [{M.ERROR_RATE_PERCENT: 0.0, M.ITL_MS: 20.0, M.REQUEST_THROUGHPUT: 4.0, M.GPU_UTIL_PERCENT: math.inf},
            {M.ITL_MS: 30.0, M.REQUEST_THROUGHPUT: 3.0}]
    assert worst_case(runs) == {M.ITL_MS: 30.0, M.REQUEST_THROUGHPUT: 3.0}


def test_margin_without_a_latency_target_is_unknown():
    assert slo_margin({M.ITL_MS: 1.0}, SloTargets()) == -math.inf


def test_close_step_rounds_and_bounds_the_note():
    step = close_step(8, [RunResult({**GOOD, M.ITL_MS: 20.123456}, "x" * 600)], CAPACITY)
    assert step.metrics[M.ITL_MS] == 20.1235 and step.cross_check == "x" * 500
    assert close_step(8, [RunResult({**GOOD, M.ITL_MS: math.inf})], CAPACITY).metrics[M.ITL_MS] == math.inf


def test_conclusions_in_full():
    nothing = conclude([], CAPACITY)
    assert (nothing.verdict_reason, nothing.message, nothing.steps) == ("no load step was measured", "no load step was measured", 0)
    fixed = conclude([_closed(32, Verdict.MET, 0.3, outputThroughput=500.0)], THROUGHPUT)
    assert (fixed.verdict_reason, fixed.message, fixed.steps) == ("Met at 32", "measured at load 32", 1)
    none_pass = conclude([_closed(4, Verdict.VIOLATED, -0.5), _closed(8, Verdict.VIOLATED, -0.9)], CAPACITY)
    assert (none_pass.verdict_reason, none_pass.message, none_pass.steps) == (
        "even the lowest load (4) fails: Violated at 4", "even the lowest load (4) fails: Violated at 4", 2)
    steps = [_closed(8, Verdict.MET, 0.5, requestThroughput=4.0), _closed(16, Verdict.MET, 0.05, requestThroughput=7.0)]
    capacity = conclude(steps, CAPACITY)
    assert (capacity.verdict_reason, capacity.message, capacity.steps) == (
        "SLO capacity 7 req/s at 16 concurrent requests: Met at 16", "2 load steps", 2)
    assert capacity.outcome(Objective.SLO_CAPACITY).reason == Reason.MEASURED.value
    unmeasured = conclude([_closed(16, Verdict.MET, 0.05)], CAPACITY)
    assert unmeasured.verdict_reason == "SLO capacity unmeasured at 16 concurrent requests: Met at 16"
    assert M.SLO_CAPACITY not in unmeasured.metrics


@pytest.mark.parametrize("watts, tokens_per_joule", [
    pytest.param(300.0, 1.6667, id="four-digits"), pytest.param(0.5, 1000.0, id="below-one-watt"),
    pytest.param(0.0, None, id="no-power"),
])
def test_tokens_per_joule(watts, tokens_per_joule):
    metrics = conclude([_closed(32, Verdict.MET, 0.3, outputThroughput=500.0, powerWatts=watts)], THROUGHPUT).metrics
    assert metrics.get(M.TOKENS_PER_JOULE) == tokens_per_joule


def test_a_capacity_of_one_is_a_neighbour():
    assert neighbours_of([(Setting(8, 90), {M.SLO_CAPACITY_LOAD: 1.0})]) == [Neighbour(Setting(8, 90), 1)]


@pytest.mark.parametrize("samples", [pytest.param(20, id="exactly-enough"), pytest.param(100, id="plenty")])
def test_enough_samples_unknown_for_another_reason_is_not_run_longer(samples):
    metrics = {M.SAMPLES: float(samples), M.ITL_MS: 20.0}  # no error rate: Unknown, but not for want of requests
    assert longer_run(metrics, 30, 30, THIN_SLO) is None


def test_a_fixed_load_rejection_quotes_its_reason_then_the_note():
    failed = StepResult(32, {}, Verdict.VIOLATED, "p95 ITL 50 ms > 36 ms", -0.4)
    assert conclude([failed], THROUGHPUT).message == "p95 ITL 50 ms > 36 ms"
    noted = StepResult(32, {}, Verdict.VIOLATED, "p95 ITL 50 ms > 36 ms", -0.4, "itlMs: 33% apart")
    assert conclude([noted], THROUGHPUT).message == "p95 ITL 50 ms > 36 ms; itlMs: 33% apart"


# ---- bracketing: short steps, the capacity measured for the full window -----------------------

BRACKETING = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=False, bracketing=True)


def _drive(capacity_short: float, capacity_full: float, config: ProtocolConfig = BRACKETING,
           seqs: int = 256) -> list[StepResult]:
    """A trial whose short windows read a capacity of `capacity_short` and full windows `capacity_full`."""
    driver = TrialDriver(Setting(seqs, 90), config)
    while (step := driver.next_step()) is not None:
        capacity = capacity_short if step.short else capacity_full
        margin = (capacity - step.load) / capacity
        metrics = {**GOOD, M.ITL_MS: 36.0 * (1 - margin)}
        driver.record(step.load, [RunResult(metrics)], full=not step.short)
        assert len(driver.steps) <= config.max_steps + EXTRA_STEPS_WHEN_MISLED + MAX_CONFIRMATIONS, driver.steps
    return driver.steps


def test_bracketing_steps_are_short_and_the_capacity_is_measured_for_the_full_window():
    steps = _drive(100, 100)
    assert [s.full for s in steps[:-1]] == [False] * (len(steps) - 1) and steps[-1].full
    best_short = max((s for s in steps if not s.full and s.passed), key=lambda s: s.load)
    assert steps[-1].load == best_short.load and steps[-1].passed
    conclusion = conclude(steps, BRACKETING)
    assert conclusion.verdict is Verdict.MET and conclusion.metrics[M.SLO_CAPACITY_LOAD] == steps[-1].load


def test_without_bracketing_every_step_is_full():
    steps = _drive(100, 100, CAPACITY)
    assert all(s.full for s in steps)


def test_a_full_window_that_fails_where_a_short_one_passed_makes_the_rest_full():
    steps = _drive(capacity_short=100, capacity_full=60)
    misled = next(i for i, s in enumerate(steps) if s.full and not s.passed)
    assert all(s.full for s in steps[misled:])
    conclusion = conclude(steps, BRACKETING)
    assert conclusion.verdict is Verdict.MET
    capacity = conclusion.metrics[M.SLO_CAPACITY_LOAD]
    assert 60 * (1 - 2 * RESOLUTION) <= capacity <= 60
    assert [s for s in steps if s.load == capacity and s.full and s.passed]


def test_a_short_pass_alone_is_never_a_capacity():
    short_pass = StepResult(40, {**GOOD}, Verdict.MET, "", 0.05, None, full=False)
    full_fail = StepResult(60, {**GOOD}, Verdict.VIOLATED, "p95 ITL over", -0.2)
    conclusion = conclude([short_pass, full_fail], BRACKETING)
    assert conclusion.verdict is Verdict.VIOLATED and M.SLO_CAPACITY not in conclusion.metrics
    assert "only short bracketing" in conclusion.verdict_reason and "(60)" in conclusion.verdict_reason


def test_confirmations_are_bounded_when_every_full_window_fails():
    steps = _drive(capacity_short=100, capacity_full=0.5)
    assert len(steps) <= BRACKETING.max_steps + EXTRA_STEPS_WHEN_MISLED + MAX_CONFIRMATIONS
    assert conclude(steps, BRACKETING).verdict is not Verdict.MET


def test_a_fixed_load_objective_never_brackets():
    config = ProtocolConfig(Objective.OUTPUT_THROUGHPUT, SLO, open_loop=False, bracketing=True)
    step = next_step([], Setting(64, 90), [], config, None, False)
    assert step is not None and not step.short


@pytest.mark.parametrize(("measure", "requested", "least", "expected"), [
    (60, None, 0.0, 15), (10, None, 0.0, 5), (60, None, 20.0, 20), (60, None, 45.0, None), (60, 0, 0.0, None),
    (60, 45, 0.0, 45), (60, 60, 0.0, None), (9, None, 0.0, None),
])
def test_bracket_seconds(measure, requested, least, expected):
    assert bracket_seconds(measure, requested, least) == expected


def test_a_failed_re_measurement_after_the_search_spent_its_steps_still_looks_below_it():
    short = [(600, 0.10), (750, -0.001), (749, -0.01), (736, -0.05), (690, -0.08)]
    steps = [StepResult(load, dict(GOOD), Verdict.MET if m >= 0 else Verdict.VIOLATED, "", m, None, False)
             for load, m in short]
    steps.append(StepResult(600, dict(GOOD), Verdict.VIOLATED, "", -0.02))  # the full window fails
    step = next_step(steps, Setting(1024, 85), [], ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=True,
                                                                     first_load=600, bracketing=True), None, False)
    assert step is not None and step.load < 600 and not step.short


# ---- a step with too few requests to judge: no verdict, not a failure ----------------------------


def _thin(load: int, samples: float = 12.0) -> StepResult:
    """A step Unknown because only `samples` requests finished (fewer than the SLO's 20)."""
    return StepResult(load, {M.SAMPLES: samples}, Verdict.UNKNOWN, "only 12 requests behind the percentiles",
                      -math.inf)


@pytest.mark.parametrize("steps, expected", [
    pytest.param([_thin(16)], 32, id="alone-the-load-doubles"),
    pytest.param([_thin(8), _thin(16)], 32, id="the-highest-unjudged-doubles"),
    pytest.param([_thin(4096)], None, id="alone-at-the-ceiling-stops"),
    pytest.param([_thin(3000)], 4096, id="doubling-is-clamped-to-the-ceiling"),
    pytest.param([_thin(16), _step(64, -0.5)], 40, id="below-a-fail-it-is-a-floor"),
    pytest.param([_step(8, -0.5), _thin(16)], 32, id="a-fail-below-it-is-no-fail-above"),
    pytest.param([_thin(100), _step(110, -0.5)], None, id="a-floor-within-the-resolution-of-the-fail-stops"),
    pytest.param([_thin(8), _step(16, 0.5)], 32, id="below-a-pass-it-says-nothing"),
    pytest.param([_thin(16, samples=19.0)], 32, id="nineteen-is-too-few"),
    pytest.param([_thin(16, samples=20.0)], 4, id="twenty-is-judged-an-unknown-steps-down"),
    pytest.param([StepResult(16, {}, Verdict.UNKNOWN, "not measured", -math.inf)], 4, id="no-sample-count-steps-down"),
])
def test_search_next_reads_too_few_requests_as_no_verdict(steps, expected):
    assert search_next(steps, SearchBounds(start=16, highest=4096)) == expected


def test_too_few_requests_follows_the_slos_min_samples():
    from batchtune.core.protocol import too_few_requests

    assert too_few_requests(_thin(16, samples=29.0), min_samples=30)
    assert not too_few_requests(_thin(16, samples=30.0), min_samples=30)
    assert not too_few_requests(StepResult(16, {M.SAMPLES: 5.0}, Verdict.VIOLATED, "", -0.5))  # judged: a fail
    config = ProtocolConfig(Objective.SLO_CAPACITY, SloTargets(itl_ms=40, min_samples=30), open_loop=False)
    assert next_load([_thin(8, samples=25.0)], Setting(16, 90), [], config) == 16


def test_a_trial_too_thin_at_every_load_says_so_at_the_highest():
    conclusion = conclude([_thin(8), _thin(16), _thin(32)], CAPACITY)
    assert conclusion.verdict is Verdict.UNKNOWN and conclusion.reason is Reason.NO_CAPACITY
    assert conclusion.verdict_reason.startswith("too few requests to judge even at the highest load tried "
                                                "(32 concurrent requests): only 12 requests")
    assert conclusion.message.startswith(conclusion.verdict_reason)


def test_a_fail_above_a_thin_step_speaks_for_the_trial():
    conclusion = conclude([_thin(8), _step(32, -0.5)], CAPACITY)
    assert conclusion.verdict is Verdict.VIOLATED
    assert conclusion.verdict_reason.startswith("even the lowest load (32) fails")


@settings(max_examples=300, deadline=None)
@given(capacity=st.floats(1.5, 3000), noise=st.lists(st.floats(0, 1), min_size=40, max_size=40),
       kindness=st.floats(0, 0.6),
       seqs=st.sampled_from([1, 4, 32, 256]), predicted=st.one_of(st.none(), st.integers(1, 4000)),
       bracketing=st.booleans(), open_loop=st.booleans(), curve=st.integers(1, 5000))
def test_a_trial_never_runs_more_steps_than_status_keeps(capacity, noise, kindness, seqs, predicted, bracketing,
                                                          open_loop, curve):
    # Status keeps every step of a running trial (api.models.MAX_STEPS_IN_STATUS is this bound): a search that ran
    # one more could not be written. Short windows that read kindly (by up to `kindness`) mislead the search and
    # fail their confirmations: the longest trials.
    from batchtune.core.protocol import MAX_STEPS_PER_TRIAL

    config = ProtocolConfig(Objective.SLO_CAPACITY, SLO, open_loop=open_loop, bracketing=bracketing,
                            first_load=60 if open_loop else None)
    steps: list[tuple[StepResult, bool]] = []
    curve_load = CurveLoad(curve, open_loop)
    while (step := next_step([s for s, _ in steps], Setting(seqs, 90), [], config, curve_load,
                             any(c for _, c in steps), predicted)) is not None:
        draw = noise[len(steps) % len(noise)]
        margin = (capacity - step.load) / capacity + (kindness * draw if step.short else 0.35 * draw - 0.3)
        result = _step(step.load, margin)
        steps.append((StepResult(result.load, result.metrics, result.verdict, "", margin, full=not step.short),
                      step.curve))
        assert len(steps) <= MAX_STEPS_PER_TRIAL, [(s.load, s.full, s.passed, c) for s, c in steps]
