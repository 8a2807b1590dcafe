"""TwinGuided (pure): calibrate, confirm while the twin predicts better, stop, distrust, fall back; the guidance
values it reads (agreement under an SLO, the basis, what status keeps)."""

from __future__ import annotations

import pytest

from batchtune.core import SearchSpace, Setting, SloTargets, TrialOutcome, make_strategy, plan_candidates
from batchtune.core.guidance import (
    Agreement,
    Predicted,
    TwinAdvice,
    advice_basis,
    agreement,
    truncated,
)
from batchtune.core.outcomes import StepObservation
from batchtune.core.strategies import Adaptive, TwinGuided
from batchtune.core.strategies._twin_guided import memory_blocked
from batchtune.core.vocabulary import M, Reason, TrialState, Verdict

SLO = SloTargets(itl_ms=50, headroom_percent=10)
PLAN = plan_candidates(SearchSpace((8, 16, 32, 64, 128), (85, 90)))
S = {(seqs, gmu): Setting(seqs, gmu) for seqs in (8, 16, 32, 64, 128) for gmu in (85, 90)}


def done(capacity: float, load: int = 10, met: bool = True) -> TrialOutcome:
    metrics = {M.SLO_CAPACITY: capacity, M.REQUEST_THROUGHPUT: capacity, M.ITL_MS: 30.0}
    step = StepObservation(load, metrics, Verdict.MET if met else Verdict.VIOLATED, 0.2)
    return TrialOutcome(TrialState.DONE, Verdict.MET if met else Verdict.VIOLATED, capacity, metrics,
                        Reason.MEASURED.value, "", (step,))


def advice(ranked: dict[tuple[int, int], float], *, trusted: bool = True, first: tuple[int, int] | None = None,
           agreements: dict[tuple[int, int], bool] | None = None, available: bool = True) -> TwinAdvice:
    order = sorted(ranked.items(), key=lambda kv: -kv[1])
    return TwinAdvice("b", available, trusted, "why", S[first] if first else None,
                      tuple(Predicted(S[k], v, 10, {}) for k, v in order),
                      {S[k]: Agreement(a, "itlMs: ...") for k, a in (agreements or {}).items()})


def ask(adv: TwinAdvice | None, history=(), pending=()):  # noqa: ANN001, ANN202
    return make_strategy("TwinGuided", PLAN, SLO, "SloCapacity", 0, 12, adv).ask(list(history), pending)


def test_first_trial_is_the_catalog_twins_best():
    adv = advice({(64, 85): 30, (32, 85): 28}, first=(64, 85))
    assert ask(adv) == S[64, 85]


def test_confirms_while_the_twin_predicts_better_than_the_best_measured_then_stops():
    history = [(S[64, 85], done(27.0))]
    assert ask(advice({(64, 85): 27.0, (128, 90): 30.0}), history) == S[128, 90]
    assert ask(advice({(64, 85): 27.0, (128, 90): 27.3}), history) is None  # within the confirm margin: done
    assert ask(advice({(64, 85): 27.0, (128, 90): 30.0}), history + [(S[128, 90], done(29.0))]) is None


def test_each_trial_waits_for_the_one_before():
    assert ask(advice({(64, 85): 30}, first=(64, 85)), pending=[S[32, 85]]) is None


def test_an_untrusted_calibration_does_not_steer_adaptive_measures_until_it_is_trusted():
    history = [(S[64, 85], done(20.0))]
    adv = advice({(64, 85): 27.0, (128, 90): 27.1}, trusted=False)
    strategy = TwinGuided(PLAN, SLO, advice=adv)
    mode, why = strategy.mode(history)
    assert mode == "measure" and "Untrusted" in why and "does not steer" in why
    assert strategy.ask(history) == Adaptive(PLAN, SLO).ask(history)
    assert strategy.ask(history) != S[128, 90]  # not the Untrusted twin's best
    two = history + [(Adaptive(PLAN, SLO).ask(history), done(21.0))]
    assert strategy.mode(two)[0] == "measure"
    assert strategy.ask(two) == Adaptive(PLAN, SLO).ask(two)
    # recalibrated on both and Trusted: the twin steers again
    trusted = TwinGuided(PLAN, SLO, advice=advice({(64, 85): 20.0, (128, 90): 30.0}))
    assert trusted.mode(two)[0] == "confirm"
    assert trusted.ask(two) == S[128, 90]


def test_confirmations_that_miss_their_prediction_hand_the_search_to_adaptive():
    history = [(S[64, 85], done(20.0)), (S[128, 90], done(22.0)), (S[32, 90], done(19.0))]
    # the calibration trial's miss does not count: it ran on the uncalibrated twin
    adv = advice({(64, 85): 20, (128, 90): 22, (16, 90): 30}, agreements={(64, 85): False, (128, 90): False})
    assert TwinGuided(PLAN, SLO, advice=adv).mode(history)[0] == "confirm"
    missed = advice({(64, 85): 20, (128, 90): 22, (16, 90): 30},
                    agreements={(64, 85): True, (128, 90): False, (32, 90): False})
    strategy = TwinGuided(PLAN, SLO, advice=missed)
    mode, why = strategy.mode(history)
    assert mode == "measure" and "2 confirmations missed" in why
    assert strategy.ask(history) == Adaptive(PLAN, SLO).ask(history)


@pytest.mark.parametrize("adv", [None, TwinAdvice("b", available=False, reason="not vLLM")], ids=["none", "unavailable"])
def test_no_twin_measures_as_adaptive(adv):  # noqa: ANN001
    assert ask(adv) == Adaptive(PLAN, SLO).ask([])


def test_rebuilt_from_the_same_advice_and_history_asks_the_same():
    history = [(S[64, 85], done(27.0))]
    adv = advice({(64, 85): 27.0, (128, 90): 30.0, (32, 90): 29.0})
    assert {ask(adv, history) for _ in range(3)} == {S[128, 90]}


@pytest.mark.parametrize(("failed", "reason", "candidate", "blocked"), [
    pytest.param((64, 90), Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, (8, 90), True, id="free-memory-same-gmu"),
    pytest.param((64, 90), Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, (128, 85), False, id="free-memory-lower-gmu"),
    pytest.param((64, 90), Reason.KV_CACHE_TOO_SMALL, (128, 85), True, id="kv-more-seqs-less-memory"),
    pytest.param((64, 90), Reason.KV_CACHE_TOO_SMALL, (32, 90), False, id="kv-fewer-seqs"),
    pytest.param((64, 85), Reason.OUT_OF_MEMORY, (128, 90), True, id="runtime-oom-less-headroom"),
    pytest.param((64, 90), Reason.OUT_OF_MEMORY, (64, 85), False, id="runtime-oom-lower-gmu-has-headroom"),
])
def test_memory_failures_rule_out_what_they_prove(failed, reason, candidate, blocked):  # noqa: ANN001
    history = [(S[failed], TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=reason.value))]
    assert (memory_blocked(S[candidate], history) is not None) is blocked


def test_agreement_is_judged_against_the_slo_limit_where_there_is_one():
    limits = {M.ITL_MS: 45.0, M.TTFT_MS: 900.0}
    # 80 vs 120 ms TTFT under a 900 ms limit: 4% of the limit, fine; ITL 40 vs 30 under 45: 22%, a miss
    ok = agreement({M.TTFT_MS: 80.0, M.ITL_MS: 30.0, M.REQUEST_THROUGHPUT: 10.0},
                   {M.TTFT_MS: 120.0, M.ITL_MS: 31.0, M.REQUEST_THROUGHPUT: 10.5}, limits)
    assert ok.agrees, ok.worst
    miss = agreement({M.ITL_MS: 30.0}, {M.ITL_MS: 40.0}, limits)
    assert not miss.agrees and "of the limit" in miss.worst
    assert not agreement({M.REQUEST_THROUGHPUT: 10.0}, {M.REQUEST_THROUGHPUT: 8.5}, limits).agrees
    # no target for E2E: it does not decide
    assert agreement({M.E2E_MS: 100.0}, {M.E2E_MS: 900.0}, limits).agrees
    assert not agreement({M.E2E_MS: 100.0}, {M.E2E_MS: 900.0}).agrees  # without limits, relative


def test_basis_names_the_measured_steps_and_status_keeps_the_measured_predictions():
    one = [(S[64, 85], done(27.0))]
    assert advice_basis(one) == advice_basis(list(one))
    assert advice_basis(one) != advice_basis(one + [(S[32, 85], done(20.0))])
    failed = [(S[128, 90], TrialOutcome(TrialState.INFEASIBLE, reason=Reason.OUT_OF_MEMORY.value))]
    assert advice_basis(one + failed) == advice_basis(one)  # only measured trials calibrate
    many = advice({k: float(i) for i, k in enumerate(S)})
    kept = truncated(many, [S[8, 85]], top=3)
    assert [p.setting for p in kept.ranked][:3] == [p.setting for p in many.ranked][:3]
    assert S[8, 85] in {p.setting for p in kept.ranked} and len(kept.ranked) == 4


def test_before_stopping_a_token_budget_ranked_near_the_best_gets_one_trial():
    plan = plan_candidates(SearchSpace((64, 128), (85,), (8192, 16384)))
    big, small, small_128 = Setting(64, 85, 16384), Setting(64, 85, 8192), Setting(128, 85, 8192)

    def adv(ranked: dict[Setting, float]) -> TwinAdvice:
        order = sorted(ranked.items(), key=lambda kv: -kv[1])
        return TwinAdvice("b", True, True, "why", None, tuple(Predicted(k, v, 10, {}) for k, v in order), {})

    def ask_(ranked: dict[Setting, float], history: list) -> Setting | None:  # noqa: ANN001
        return make_strategy("TwinGuided", plan, SLO, "SloCapacity", 0, 12, adv(ranked)).ask(history, ())

    history = [(big, done(27.0))]
    # Nothing predicted 2% better: the other budget's best (within 5% of the best) is measured once.
    assert ask_({big: 27.0, small_128: 26.5, small: 26.0}, history) == small_128
    assert ask_({big: 27.0, small_128: 25.0}, history) is None  # over 5% below: not worth a trial
    assert ask_({big: 27.0, small_128: 26.5, small: 26.0}, history + [(small_128, done(26.0))]) is None
