"""The burst probe: the load that fills the token budget, and what a failed burst rules out."""

from __future__ import annotations

import pytest

from batchtune.core import SearchSpace, Setting, SloTargets, TrialOutcome, make_strategy, plan_candidates
from batchtune.core.burst import Burst, burst_excluded, burst_failed, burst_of
from batchtune.core.selection import CompletedTrial, select_best
from batchtune.core.vocabulary import Reason, TrialState, Verdict


@pytest.mark.parametrize(("setting", "budget", "max_model_len", "burst"), [
    pytest.param(Setting(256, 90, 16384), 16384, 32768, Burst(2, 16384), id="one-prompt-fills-it"),
    pytest.param(Setting(256, 90, 16384), 16384, 4096, Burst(10, 4095), id="model-length-caps-the-prompt"),
    pytest.param(Setting(4, 90, 16384), 16384, 2048, Burst(4, 2047), id="at-most-max-num-seqs"),
    pytest.param(Setting(64, 90), 8192, None, Burst(2, 8192), id="engine-default-budget"),
])
def test_burst_fills_the_budget(setting, budget, max_model_len, burst):
    found = burst_of(setting, budget, max_model_len)
    assert found == burst
    assert found.concurrency <= setting.max_num_seqs
    assert found.tokens >= budget or found.concurrency == setting.max_num_seqs


@pytest.mark.parametrize(("budget", "max_model_len", "field"), [
    pytest.param(0, None, "budget_tokens", id="no-budget"),
    pytest.param(8192, 1, "max_model_len", id="no-room-for-a-prompt"),
])
def test_burst_refuses_bad_input(budget, max_model_len, field):
    with pytest.raises(ValueError, match=field):
        burst_of(Setting(8, 90), budget, max_model_len)


FAILED = Setting(64, 94, 8192)
HISTORY = [(FAILED, burst_failed(FAILED, Burst(2, 8192), "torch.OutOfMemoryError: CUDA out of memory"))]


@pytest.mark.parametrize(("setting", "excluded"), [
    pytest.param(FAILED, True, id="itself"),
    pytest.param(Setting(8, 94, 8192), True, id="any-seqs-same-column"),
    pytest.param(Setting(64, 98, 16384), True, id="higher-gmu-larger-budget"),
    pytest.param(Setting(64, 92, 8192), False, id="lower-gmu"),
    pytest.param(Setting(64, 98, 4096), False, id="smaller-budget"),
    pytest.param(Setting(64, 98), False, id="default-budget"),
])
def test_a_failed_burst_excludes_its_column_and_higher_gmu(setting, excluded):
    assert (burst_excluded(setting, HISTORY) is not None) is excluded


def _met(setting: Setting, value: float) -> TrialOutcome:
    metrics = {"e2eMs": 500.0, "errorRatePercent": 0.0, "sloCapacity": value, "requestThroughput": value}
    return TrialOutcome(TrialState.DONE, Verdict.MET, value, metrics)


def test_selection_never_picks_a_setting_a_failed_burst_rules_out():
    slo = SloTargets(e2e_ms=1000)
    trials = [CompletedTrial("t0", Setting(32, 98, 8192), _met(Setting(32, 98, 8192), 10.0)),
              CompletedTrial("t1", Setting(32, 90, 8192), _met(Setting(32, 90, 8192), 8.0)),
              CompletedTrial("b", *HISTORY[0])]
    selection = select_best(trials, "SloCapacity", slo)
    assert selection.best == Setting(32, 90, 8192)
    assert "full token-budget burst ran out of memory" in selection.verdicts["t0"]
    assert HISTORY[0][1].reason == Reason.BURST_OUT_OF_MEMORY


def test_adaptive_closes_the_columns_a_failed_burst_rules_out():
    plan = plan_candidates(SearchSpace((8, 16, 32, 64), (90, 94, 98), (8192,)))
    strategy = make_strategy("Adaptive", plan, SloTargets(e2e_ms=1000), "SloCapacity", 0, 32)
    skipped = {p.setting: p.message for p in strategy.skipped(HISTORY)}
    assert all(Setting(s, g, 8192) in skipped for s in (8, 16, 32) for g in (94, 98))
    assert not any(s.gpu_memory_utilization_percent == 90 for s in skipped)
    asked = strategy.ask(HISTORY)
    assert asked is not None and asked.gpu_memory_utilization_percent == 90
