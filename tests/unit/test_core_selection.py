"""Selection: best feasible by objective, the knee, headroom, and reasons for every trial."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchtune.core import (
    CompletedTrial,
    CurvePoint,
    Setting,
    SloTargets,
    TrialOutcome,
    TrialState,
    Verdict,
    find_knee,
    select_best,
)
from batchtune.core.knee import Knee, curve_point, gain_per_doubling, mean_point
from batchtune.core.vocabulary import FINISHED_TRIAL_STATES

SLO = SloTargets(e2e_ms=2000, headroom_percent=10)


def done(seqs, throughput, e2e, verdict=Verdict.MET, gmu=90, error=0.0, name=None, objective=...):
    metrics = {"outputThroughput": throughput, "e2eMs": e2e, "errorRatePercent": error}
    objective = throughput if objective is ... else objective
    return CompletedTrial(name or f"t-{seqs}-{gmu}", Setting(seqs, gmu), TrialOutcome(TrialState.DONE, verdict, objective, metrics))


def test_knee_detection():
    points = [CurvePoint(8, 800, 100), CurvePoint(16, 1500, 110), CurvePoint(32, 2600, 130),
              CurvePoint(64, 2800, 200), CurvePoint(128, 2900, 400)]
    knee = find_knee(points)
    assert knee is not None and knee.max_num_seqs == 32 and "below 10%" in knee.reason
    # Flat throughput but falling latency is not a knee.
    assert find_knee([CurvePoint(8, 100, 300), CurvePoint(16, 101, 200)]) is None
    assert find_knee([CurvePoint(8, 100, 100), CurvePoint(16, 190, 120)]) is None


def test_knee_reason_quotes_gain_throughput_and_latency():
    knee = find_knee([CurvePoint(8, 100, 300), CurvePoint(16, 105, 400)])
    assert knee == Knee(8, "throughput gains 5.0% per doubling from max-num-seqs 8 to 16 (100 -> 105), latency 300 -> 400 ms, below 10%")
    knee = find_knee([CurvePoint(8, 100), CurvePoint(16, 105, 400)])
    assert knee == Knee(8, "throughput gains 5.0% per doubling from max-num-seqs 8 to 16 (100 -> 105), below 10%")


def test_knee_needs_latency_to_rise_and_gain_to_fall_below_the_threshold():
    # Equal latency does not rise: no knee.
    assert find_knee([CurvePoint(8, 100, 300), CurvePoint(16, 101, 300)]) is None
    # A gain exactly at the threshold is still worth it.
    assert find_knee([CurvePoint(8, 100, 100), CurvePoint(16, 150, 200)], threshold_percent=50) is None
    # A flat step with falling latency does not end the search: the next step is the knee.
    knee = find_knee([CurvePoint(8, 100, 300), CurvePoint(16, 101, 200), CurvePoint(32, 102, 400)])
    assert knee is not None and knee.max_num_seqs == 16
    # Every adjacent pair is looked at, in max-num-seqs order.
    knee = find_knee([CurvePoint(32, 300, 150), CurvePoint(8, 100, 100), CurvePoint(16, 200, 120), CurvePoint(64, 310, 300)])
    assert knee is not None and knee.max_num_seqs == 32


def test_gain_per_doubling():
    assert gain_per_doubling(CurvePoint(8, 100), CurvePoint(32, 169)) == pytest.approx(30.0)
    assert gain_per_doubling(CurvePoint(8, 100), CurvePoint(16, 150)) == pytest.approx(50.0)


@pytest.mark.parametrize("metrics, point", [
    pytest.param({"outputThroughput": 100, "e2eMs": 900, "itlMs": 30}, CurvePoint(8, 100, 900), id="e2e-first"),
    pytest.param({"outputThroughput": 100, "e2eMs": math.nan, "itlMs": 30, "ttftMs": 200}, CurvePoint(8, 100, 30), id="first-finite-latency"),
    pytest.param({"outputThroughput": 100, "ttftMs": 200}, CurvePoint(8, 100, 200), id="ttft-last"),
    pytest.param({"outputThroughput": 100}, CurvePoint(8, 100, None), id="no-latency"),
    pytest.param({"outputThroughput": math.inf, "requestThroughput": 5}, CurvePoint(8, 5, None), id="inf-throughput-is-skipped"),
    pytest.param({"requestThroughput": 0.5}, CurvePoint(8, 0.5, None), id="below-one-is-a-throughput"),
    pytest.param({"requestThroughput": 0}, None, id="zero-throughput"),
    pytest.param({"outputThroughput": "x", "e2eMs": 100}, None, id="junk-throughput"),
])
def test_curve_point(metrics, point):
    assert curve_point(8, metrics) == point


def test_prefers_knee_within_headroom():
    trials = [done(8, 800, 100), done(16, 1500, 110), done(32, 2600, 130), done(64, 2800, 200),
              done(128, 2900, 400), done(256, 2950, 5000, Verdict.VIOLATED)]
    sel = select_best(trials, "OutputThroughput", SLO)
    # 2900 is the best; 32 (the knee) gives 2600 < 90% of 2900 = 2610, so 64 (past the knee) would be...
    assert sel.knee is not None and sel.knee.max_num_seqs == 32
    assert sel.best == Setting(128, 90)
    assert "headroom" in sel.reason
    sel = select_best(trials, "OutputThroughput", SloTargets(e2e_ms=2000, headroom_percent=15))
    assert sel.best == Setting(32, 90) and sel.best_trial == "t-32-90"
    assert sel.verdicts["t-32-90"].startswith("chosen: seqs=32 gmu=90%: at or below the knee")
    assert sel.verdicts["t-128-90"].startswith("not chosen: best")
    assert sel.verdicts["t-256-90"].startswith("rejected: SLO violated")


def _curve(top=1000.0, at_knee=900.0, *extra):
    # Gains per doubling 100%, 50%, then 11% (1000) or less: with a 20% threshold the knee is at 32.
    return [done(8, 300, 100), done(16, 600, 110), done(32, at_knee, 120), done(64, top, 300), *extra]


def test_a_setting_at_the_knee_exactly_at_the_headroom_floor_is_kept():
    other_column = done(16, 950, 150, gmu=80)
    sel = select_best(_curve(1000, 900, other_column), "OutputThroughput", SLO, knee_threshold_percent=20)
    assert sel.best == Setting(32, 90)
    assert sel.reason == (
        "seqs=32 gmu=90%: at or below the knee (max-num-seqs 32: throughput gains 11.1% per doubling from max-num-seqs 32 "
        "to 64 (900 -> 1000), latency 120 -> 300 ms, below 20%); output throughput 900 tok/s is within 10% of the best "
        "(seqs=64 gmu=90%, 1000), so the margin is kept")
    assert sel.verdicts["t-64-90"] == ("not chosen: best output throughput 1000 tok/s but past the knee; "
                                       "seqs=32 gmu=90% keeps headroom")
    assert sel.verdicts["t-16-90"] == "not chosen: met the SLO with output throughput 600 tok/s, below 900 of seqs=32 gmu=90%"
    assert sel.verdicts["t-16-80"] == ("not chosen: met the SLO with output throughput 950 tok/s; seqs=32 gmu=90% was "
                                       "preferred for keeping headroom below the knee")


def test_past_the_knee_when_staying_below_costs_more_than_the_headroom():
    sel = select_best(_curve(1000, 899), "OutputThroughput", SLO, knee_threshold_percent=20)
    assert sel.best == Setting(64, 90)
    assert sel.reason == (
        "seqs=64 gmu=90%: highest output throughput 1000 tok/s of 4 setting(s) meeting the SLO; past the knee at "
        "max-num-seqs 32, but staying below it would cost more than the 10% headroom")


def test_the_knee_threshold_is_the_callers():
    assert select_best(_curve(1000, 899), "OutputThroughput", SLO).knee is None
    assert select_best(_curve(1000, 899), "OutputThroughput", SLO, knee_threshold_percent=20).knee is not None


def test_best_at_the_knee_and_a_knee_drawn_from_violated_trials():
    # The curve is physical: a Done trial that violated the SLO still draws it.
    trials = _curve(1000, 900)[:3] + [done(64, 1000, 9000, Verdict.VIOLATED)]
    sel = select_best(trials, "OutputThroughput", SLO, knee_threshold_percent=20)
    assert sel.best == Setting(32, 90)
    assert sel.reason == "seqs=32 gmu=90%: highest output throughput 900 tok/s of 3 setting(s) meeting the SLO; knee at max-num-seqs 32"
    assert sel.knee is not None and sel.knee.max_num_seqs == 32


def test_nothing_eligible_still_reports_the_knee():
    trials = [done(seqs, t, e2e, Verdict.VIOLATED) for seqs, t, e2e in ((8, 300, 9000), (16, 600, 9100), (32, 900, 9200), (64, 1000, 9900))]
    sel = select_best(trials, "OutputThroughput", SLO, knee_threshold_percent=20)
    assert sel.best is None and sel.knee is not None and sel.knee.max_num_seqs == 32


def test_a_setting_with_no_curve_point_does_not_hide_the_knee():
    failed = CompletedTrial("t-4-90", Setting(4, 90), TrialOutcome(TrialState.FAILED, reason="ReadinessTimeout"))
    sel = select_best([failed, *_curve(1000, 900)], "OutputThroughput", SLO, knee_threshold_percent=20)
    assert sel.knee is not None and sel.knee.max_num_seqs == 32


def test_without_an_slo_there_is_no_headroom():
    # 995 is within 1% of 1000 but, with no headroom, the best is taken past the knee.
    sel = select_best(_curve(1000, 995), "OutputThroughput", knee_threshold_percent=20)
    assert sel.best == Setting(64, 90) and sel.knee is not None and sel.knee.max_num_seqs == 32
    assert "past the knee" in sel.reason and "0% headroom" in sel.reason


def test_repeats_are_averaged_for_the_objective_and_the_curve():
    trials = [done(8, 300, 100), done(16, 600, 100, name="t-16-90"), done(16, 700, 140, name="t-16-90-r1"),
              done(32, 660, 300)]
    sel = select_best(trials, "OutputThroughput", SLO, knee_threshold_percent=20)
    assert sel.knee is not None
    assert sel.knee.reason == ("throughput gains 1.5% per doubling from max-num-seqs 16 to 32 (650 -> 660), "
                               "latency 120 -> 300 ms, below 20%")
    assert "output throughput 650 tok/s" in sel.verdicts["t-16-90-r1"]


def test_a_tie_names_the_setting_that_ranks_first():
    sel = select_best([done(16, 900, 100), done(32, 900, 120)], "OutputThroughput", SLO)
    assert sel.best == Setting(16, 90)
    assert sel.verdicts["t-32-90"] == ("not chosen: met the SLO with output throughput 900 tok/s, the same as "
                                       "seqs=16 gmu=90%, which ranks first as the smaller setting")


def test_mean_point_of_repeats():
    assert mean_point([CurvePoint(16, 600, 100), CurvePoint(16, 700), CurvePoint(16, 800, 140)]) == CurvePoint(16, 700, 120)
    assert mean_point([CurvePoint(16, 600)]) == CurvePoint(16, 600, None)


def test_rejection_wording():
    trials = [
        CompletedTrial("failed", Setting(4, 90), TrialOutcome(TrialState.FAILED)),
        CompletedTrial("violated", Setting(8, 90), TrialOutcome(TrialState.DONE, Verdict.VIOLATED, 1, message="p95 E2E too high")),
        CompletedTrial("unknown", Setting(16, 90), TrialOutcome(TrialState.DONE, Verdict.UNKNOWN, 1)),
        done(32, 900, 5000),
    ]
    verdicts = select_best(trials, "OutputThroughput", SLO).verdicts
    assert verdicts == {
        "failed": "rejected: trial Failed",
        "violated": "rejected: SLO violated (p95 E2E too high)",
        "unknown": "rejected: SLO unknown",
        "t-32-90": "rejected: SLO violated on re-evaluation (p95 E2E latency 5000 ms > 1800 ms "
                   "(2000 ms target less 10% headroom))",
    }


def test_the_objective_comes_from_the_outcome_or_else_from_the_metrics():
    from_metrics = done(8, 800, 100, objective=None)
    measured = CompletedTrial("t-16-90", Setting(16, 90), TrialOutcome(TrialState.DONE, Verdict.MET, 500, {"e2eMs": 100, "errorRatePercent": 0}))
    sel = select_best([from_metrics, measured], "OutputThroughput", SLO)
    assert sel.best == Setting(8, 90)
    assert sel.verdicts["t-16-90"] == "not chosen: met the SLO with output throughput 500 tok/s, below 800 of seqs=8 gmu=90%"
    unmeasured = done(8, None, 100, objective=None)
    assert select_best([unmeasured], "OutputThroughput", SLO).verdicts["t-8-90"] == "rejected: output throughput was not measured"


def test_rejects_with_reasons():
    trials = [
        done(8, 800, 100),
        CompletedTrial("oom", Setting(512, 90), TrialOutcome(TrialState.INFEASIBLE, reason="KvCacheTooSmall", message="KV cache too small")),
        CompletedTrial("timeout", Setting(256, 90), TrialOutcome(TrialState.FAILED, reason="ReadinessTimeout")),
        done(16, 1500, None, Verdict.MET),  # claims Met, but E2E was not measured: re-evaluation rejects
        done(32, 9000, 100, Verdict.UNKNOWN),
    ]
    sel = select_best(trials, "OutputThroughput", SLO)
    assert sel.best == Setting(8, 90)
    assert sel.verdicts["oom"] == "rejected: trial Infeasible (KV cache too small)"
    assert sel.verdicts["timeout"] == "rejected: trial Failed (ReadinessTimeout)"
    assert "re-evaluation" in sel.verdicts["t-16-90"]
    assert sel.verdicts["t-32-90"].startswith("rejected: SLO unknown")


def test_nothing_eligible():
    sel = select_best([done(8, 800, 9000, Verdict.VIOLATED)], "OutputThroughput", SLO)
    assert sel.best is None and "no trial met the SLO" in sel.reason
    assert select_best([], "OutputThroughput", SLO).reason == "no trial has finished"


def test_repeats_must_all_pass():
    a = done(8, 800, 100)
    b = CompletedTrial("t-8-90-r1", Setting(8, 90), TrialOutcome(TrialState.DONE, Verdict.VIOLATED, 800, {}))
    sel = select_best([a, b, done(4, 400, 90)], "OutputThroughput", SLO)
    assert sel.best == Setting(4, 90)
    assert "another repeat" in sel.verdicts["t-8-90"]


_verdicts = st.sampled_from(list(Verdict))
_states = st.sampled_from(sorted(FINISHED_TRIAL_STATES))  # an outcome is always of a finished trial
_numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1e5))


@st.composite
def _trials(draw):
    out = []
    for i in range(draw(st.integers(0, 12))):
        setting = Setting(draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64])), draw(st.sampled_from([85, 90])))
        metrics = {"outputThroughput": draw(_numbers), "e2eMs": draw(_numbers), "errorRatePercent": draw(_numbers)}
        outcome = TrialOutcome(draw(_states), draw(_verdicts), draw(_numbers), metrics)
        out.append(CompletedTrial(f"trial-{i}", setting, outcome))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_trials(), st.integers(0, 50))
def test_never_picks_a_trial_without_a_met_slo(trials, headroom):
    slo = SloTargets(e2e_ms=2000, headroom_percent=headroom)
    sel = select_best(trials, "OutputThroughput", slo)
    assert set(sel.verdicts) == {t.name for t in trials}
    if sel.best is None:
        return
    for t in trials:
        if t.setting == sel.best:
            assert t.outcome.state is TrialState.DONE and t.outcome.verdict is Verdict.MET
            value = float(t.outcome.metrics["e2eMs"])
            assert math.isfinite(value) and value <= 2000 * (100 - headroom) / 100
