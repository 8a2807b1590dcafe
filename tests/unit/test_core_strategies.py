"""Strategies: determinism, resumability, budget, and Adaptive's efficiency on monotone curves."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtune.core import SearchSpace, Setting, SloTargets, TrialOutcome, make_strategy, plan_candidates
from batchtune.core.outcomes import TrialState as ReexportedTrialState
from batchtune.core.outcomes import Verdict as ReexportedVerdict
from batchtune.core.planning import PrunedSetting, doublings
from batchtune.core.search import Search, learned_from_pruned
from batchtune.core.strategies import blocked_reason
from batchtune.core.vocabulary import M, Reason, TrialState, Verdict

SLO = SloTargets(e2e_ms=1000)
KINDS = ["Grid", "Adaptive", "Bayesian"]


def synthetic(boundary: int, knee: int = 64, kv: float = 50.0, infeasible_from: int | None = None,
              gmu_boost: dict[int, int] | None = None):
    """Latency grows with seqs; SLO met up to `boundary` (scaled per gmu); throughput flattens at `knee`."""
    def run(s: Setting) -> TrialOutcome:
        if infeasible_from is not None and s.max_num_seqs >= infeasible_from and s.gpu_memory_utilization_percent <= 90:
            return TrialOutcome(TrialState.INFEASIBLE, reason=Reason.KV_CACHE_TOO_SMALL)
        limit = boundary * (gmu_boost or {}).get(s.gpu_memory_utilization_percent, 1)
        met = s.max_num_seqs <= limit
        throughput = 100.0 * min(s.max_num_seqs, knee) + s.max_num_seqs
        metrics = {"outputThroughput": throughput, "e2eMs": 100 + s.max_num_seqs, "kvCacheUsagePercent": kv,
                   "preemptionsPerSecond": 0.0}
        return TrialOutcome(TrialState.DONE, Verdict.MET if met else Verdict.VIOLATED, throughput, metrics)
    return run


def drive(kind, plan, run, seed=0, max_trials=64):
    strategy = make_strategy(kind, plan, SLO, "OutputThroughput", seed, max_trials)
    history = []
    while (s := strategy.ask(history)) is not None:
        assert s in plan.candidates and s not in {h[0] for h in history}
        history.append((s, run(s)))
    return history


def largest_met(history):
    return max((s.max_num_seqs for s, o in history if o.met), default=None)


PLAN_1D = plan_candidates(SearchSpace(doublings(1, 1024)))


@pytest.mark.parametrize("boundary", [1, 3, 8, 100, 256, 1024, 0])
def test_adaptive_finds_boundary_with_fewer_trials_than_grid(boundary):
    run = synthetic(boundary)
    grid, adaptive = drive("Grid", PLAN_1D, run), drive("Adaptive", PLAN_1D, run)
    assert largest_met(adaptive) == largest_met(grid)
    assert len(adaptive) < len(grid)
    assert len(adaptive) <= 6  # log2(11) + a knee probe


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_trials", [1, 3, 5])
def test_max_trials_respected(kind, max_trials):
    tried = len(drive(kind, PLAN_1D, synthetic(100), max_trials=max_trials))
    # Adaptive may finish early (it converged); the others use the whole budget.
    assert tried <= max_trials if kind == "Adaptive" else tried == max_trials


PLAN_2D = plan_candidates(SearchSpace(doublings(4, 512), (80, 90, 95), (2048, 8192)))


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(KINDS), st.integers(0, 2**31 - 1), st.integers(0, 8), st.sampled_from([4, 32, 100, 512]))
def test_same_seed_and_history_same_next(kind, seed, n, boundary):
    run = synthetic(boundary)
    history = drive(kind, PLAN_2D, run, seed=seed, max_trials=n) if n else []
    first = make_strategy(kind, PLAN_2D, SLO, "OutputThroughput", seed, 64)
    rebuilt = make_strategy(kind, PLAN_2D, SLO, "OutputThroughput", seed, 64)
    assert first.ask(history) == rebuilt.ask(list(history))
    # tell() keeps the same history internally and asks the same.
    for setting, outcome in history:
        rebuilt.tell(setting, outcome)
    assert rebuilt.ask() == first.ask(history)


@pytest.mark.parametrize("kind", KINDS)
def test_pending_settings_are_not_asked_again(kind):
    strategy = make_strategy(kind, PLAN_2D, SLO, "OutputThroughput", 1, 64)
    pending: list[Setting] = []
    for _ in range(4):
        s = strategy.ask([], pending=pending)
        if s is None:
            break
        assert s not in pending
        pending.append(s)
    assert pending


def test_adaptive_skips_higher_gmu_when_not_kv_bound():
    history = drive("Adaptive", plan_candidates(SearchSpace(doublings(4, 512), (80, 90, 95))), synthetic(100, kv=40.0))
    assert {s.gpu_memory_utilization_percent for s, _ in history} == {80}
    strategy = make_strategy("Adaptive", plan_candidates(SearchSpace(doublings(4, 512), (80, 90, 95))), SLO, seed=0, max_trials=64)
    skipped = strategy.skipped(history)
    assert {p.reason for p in skipped} == {Reason.DOMINATED}
    assert any("not KV-bound" in p.message for p in skipped)


def test_adaptive_escalates_gmu_when_kv_bound():
    plan = plan_candidates(SearchSpace(doublings(4, 512), (80, 90, 95)))
    history = drive("Adaptive", plan, synthetic(64, kv=97.0, gmu_boost={90: 2, 95: 4}))
    assert largest_met(history) == 256
    assert {s.gpu_memory_utilization_percent for s, _ in history} == {80, 90, 95}
    assert len(history) < len(plan.candidates)


def test_adaptive_prunes_memory_failures_at_same_or_lower_gmu_only():
    plan = plan_candidates(SearchSpace(doublings(4, 512), (85, 90, 95)))
    history = drive("Adaptive", plan, synthetic(512, infeasible_from=64))
    tried = {s for s, _ in history}
    # No setting is tried once an earlier memory failure implies it cannot fit.
    for i, (setting, _) in enumerate(history):
        assert blocked_reason(setting, history[:i]) is None, setting
    failures = [s for s, o in history if o.state is TrialState.INFEASIBLE]
    assert Setting(64, 90) in failures or Setting(128, 90) in failures  # higher gmu was still worth a try
    # gmu 95 is not ruled out by failures at lower gmu, and reaches the boundary.
    assert any(s.gpu_memory_utilization_percent == 95 and s.max_num_seqs >= 64 for s in tried)
    assert largest_met(history) == 512


def test_adaptive_gmu_too_high_rules_out_higher_gmu():
    plan = plan_candidates(SearchSpace(doublings(4, 64), (90, 95)))

    def run(s):
        if s.gpu_memory_utilization_percent >= 90:
            return TrialOutcome(TrialState.INFEASIBLE, reason=Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH)
        raise AssertionError

    history = drive("Adaptive", plan, run)
    assert len(history) == 1


def test_adaptive_steps_around_unknown_verdicts():
    def run(s):
        if s.max_num_seqs == 32:
            return TrialOutcome(TrialState.DONE, Verdict.UNKNOWN, None, {})
        return synthetic(100)(s)
    history = drive("Adaptive", PLAN_1D, run)
    assert largest_met(history) == 64
    assert len(history) < len(PLAN_1D.candidates)


def test_bayesian_explores_the_space_and_finds_a_feasible_point():
    history = drive("Bayesian", PLAN_2D, synthetic(100), seed=3, max_trials=12)
    assert len(history) == 12 and any(o.met for _, o in history)
    assert len({s for s, _ in history}) == 12


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="strategy.type 'Random'"):
        make_strategy("Random", PLAN_1D, SLO)


def _capacity_run(gmu_boost: dict[int, int], *, passing_kv: float, peak_kv: float | None, peaks_preempt: float = 0.0):
    """SLO capacity met up to seqs 64 (x gmu boost); the passing step's KV usage is low, the failing
    step above it fills the cache (reported only as the trial's peak, as the operator does)."""
    def run(s: Setting) -> TrialOutcome:
        limit = 64 * gmu_boost.get(s.gpu_memory_utilization_percent, 1)
        metrics = {"e2eMs": 100.0, "kvCacheUsagePercent": passing_kv, "preemptionsPerSecond": 0.0}
        if peak_kv is not None:
            metrics |= {"kvCacheUsagePeakPercent": peak_kv, "preemptionsPeakPerSecond": peaks_preempt}
        if s.max_num_seqs > limit:
            return TrialOutcome(TrialState.DONE, Verdict.VIOLATED, None, {**metrics, "e2eMs": 5000.0})
        return TrialOutcome(TrialState.DONE, Verdict.MET, float(s.max_num_seqs), metrics)
    return run


@pytest.mark.parametrize(("peak_kv", "preempt", "escalates"), [
    pytest.param(97.0, 0.0, True, id="failing-step-fills-the-cache"),
    pytest.param(60.0, 1.5, True, id="failing-step-preempts"),
    pytest.param(60.0, 0.0, False, id="cache-never-fills"),
])
def test_adaptive_gmu_gate_reads_the_peak_over_load_steps(peak_kv, preempt, escalates):
    # The passing step's usage (70%) is under the KV-bound line; only the peak tells.
    plan = plan_candidates(SearchSpace(doublings(4, 512), (80, 90)))
    history = drive("Adaptive", plan, _capacity_run({90: 4}, passing_kv=70.0, peak_kv=peak_kv, peaks_preempt=preempt))
    assert (90 in {s.gpu_memory_utilization_percent for s, _ in history}) is escalates
    assert largest_met(history) == (256 if escalates else 64)


def _stream_run(s: Setting) -> TrialOutcome:
    """512 closed-loop users: below seqs 128 requests queue (TTFT fails), above 128 ITL fails."""
    seqs = s.max_num_seqs
    metrics = {"ttftMs": 100.0 if seqs >= 128 else 5000.0, "itlMs": 10.0 if seqs <= 128 else 80.0,
               "waitingRequests": float(max(0, 512 - seqs)), "outputThroughput": 40.0 * seqs}
    met = seqs == 128
    return TrialOutcome(TrialState.DONE, Verdict.MET if met else Verdict.VIOLATED,
                        metrics["outputThroughput"] if met else None, metrics)


def test_adaptive_reads_queued_ttft_violation_as_too_small():
    # The first bisection point (64) queues; read as an upper bound it would end the search with nothing.
    slo = SloTargets(ttft_ms=1000, itl_ms=40)
    plan = plan_candidates(SearchSpace(doublings(4, 1024)))
    strategy = make_strategy("Adaptive", plan, slo, "OutputThroughput", 0, 64)
    history = []
    while (s := strategy.ask(history)) is not None:
        history.append((s, _stream_run(s)))
    assert history[0][0].max_num_seqs < 128
    assert largest_met(history) == 128
    assert len(history) <= 4
    assert any("too small for the load" in p.message for p in strategy.skipped(history))


@pytest.mark.parametrize(("metrics", "too_small"), [
    pytest.param({"ttftMs": 5000.0, "itlMs": 10.0, "waitingRequests": 30.0}, True, id="ttft-only-with-queue"),
    pytest.param({"ttftMs": 5000.0, "itlMs": 10.0, "waitingRequests": 0.0}, False, id="no-queue"),
    pytest.param({"ttftMs": 5000.0, "itlMs": 10.0}, False, id="queue-unmeasured"),
    pytest.param({"ttftMs": 5000.0, "itlMs": 80.0, "waitingRequests": 30.0}, False, id="itl-fails-too"),
    pytest.param({"ttftMs": 5000.0, "waitingRequests": 30.0}, False, id="itl-unmeasured"),
    pytest.param({"ttftMs": 100.0, "itlMs": 80.0, "waitingRequests": 30.0}, False, id="itl-only"),
    pytest.param({"ttftMs": 5000.0, "itlMs": 10.0, "waitingRequests": 30.0, "preemptionsPerSecond": 2.0}, False,
                 id="kv-preempts"),
    pytest.param({"ttftMs": 5000.0, "itlMs": 10.0, "waitingRequests": 30.0, "kvCacheUsagePeakPercent": 97.0}, False,
                 id="kv-full"),
])
def test_queued_miss(metrics, too_small):
    from batchtune.core.strategies._adaptive import queued_miss

    outcome = TrialOutcome(TrialState.DONE, Verdict.VIOLATED, None, metrics)
    assert queued_miss(outcome, SloTargets(ttft_ms=1000, itl_ms=40)) is too_small


@pytest.mark.parametrize(("metrics", "too_small"), [
    pytest.param({"e2eMs": 30000.0, "waitingRequests": 900.0}, True, id="e2e-with-queue"),
    pytest.param({"e2eMs": 30000.0, "waitingRequests": 0.0}, False, id="e2e-without-queue"),
    pytest.param({"e2eMs": 30000.0, "waitingRequests": 900.0, "preemptionsPeakPerSecond": 1.0}, False,
                 id="e2e-kv-preempts"),
    pytest.param({"e2eMs": 500.0, "waitingRequests": 900.0}, False, id="e2e-met"),
])
def test_queued_miss_e2e_only(metrics, too_small):
    from batchtune.core.strategies._adaptive import queued_miss

    outcome = TrialOutcome(TrialState.DONE, Verdict.VIOLATED, None, metrics)
    assert queued_miss(outcome, SloTargets(e2e_ms=10000)) is too_small


def _offline_run(s: Setting) -> TrialOutcome:
    """1024 closed-loop users and an E2E-only SLO of 10 s: a request's E2E is mostly its wait in the queue
    (Little's law, users / request throughput), so below 256 seqs the SLO fails with requests waiting."""
    users = 1024
    throughput = 0.5 * min(s.max_num_seqs, 512)  # req/s
    e2e_ms = 1000.0 * users / throughput
    metrics = {"e2eMs": e2e_ms, "waitingRequests": float(max(0, users - s.max_num_seqs)),
               "outputThroughput": 512.0 * throughput, "kvCacheUsagePercent": 40.0, "preemptionsPerSecond": 0.0,
               "errorRatePercent": 0.0}
    met = e2e_ms <= 9000.0  # the 10 % headroom
    return TrialOutcome(TrialState.DONE, Verdict.MET if met else Verdict.VIOLATED,
                        metrics["outputThroughput"] if met else None, metrics)


def test_adaptive_searches_up_from_an_e2e_only_queueing_miss_and_chooses():
    # Issue 21: read as "batch too big", the misses at 64, 16, 8 walked the search down to nothing, and the
    # memory gate closed the higher-gmu column: no choice.
    from batchtune.core.selection import CompletedTrial, select_best

    slo = SloTargets(e2e_ms=10000)
    plan = plan_candidates(SearchSpace(doublings(8, 1024), (85, 90)))
    strategy = make_strategy("Adaptive", plan, slo, "OutputThroughput", 0, 12)
    history = []
    while (s := strategy.ask(history)) is not None:
        history.append((s, _offline_run(s)))
    assert history[0][1].verdict is Verdict.VIOLATED  # it starts below the boundary, where the queue fails it
    selection = select_best([CompletedTrial(f"t{i}", s, o) for i, (s, o) in enumerate(history)], "OutputThroughput",
                            slo)
    assert selection.best is not None and selection.best.max_num_seqs >= 256
    assert any("missed the SLO with requests waiting" in p.message for p in strategy.skipped(history))


def test_adaptive_probes_below_when_the_smallest_batch_measured_scores_best():
    # Every batch meets the SLO and latency does not rise (no knee), but capacity falls past 16:
    # bisection starts in the middle and would never look below it.
    def run(s: Setting) -> TrialOutcome:
        value = 100.0 - abs(s.max_num_seqs.bit_length() - 5)
        metrics = {"e2eMs": 500.0, "requestThroughput": value, "sloCapacity": value}
        return TrialOutcome(TrialState.DONE, Verdict.MET, value, metrics)

    strategy = make_strategy("Adaptive", PLAN_1D, SLO, "SloCapacity", 0, 64)
    history = []
    while (s := strategy.ask(history)) is not None:
        history.append((s, run(s)))
    best = max(history, key=lambda h: h[1].objective)[0]
    assert best.max_num_seqs == 16
    assert len(history) < len(PLAN_1D.candidates)


def test_outcomes_reexports_the_vocabulary():
    assert ReexportedTrialState is TrialState and ReexportedVerdict is Verdict


@pytest.mark.parametrize("state", [
    pytest.param(TrialState.PENDING, id="pending"),
    pytest.param(TrialState.DEPLOYING, id="deploying"),
    pytest.param(TrialState.WARMING, id="warming"),
    pytest.param(TrialState.MEASURING, id="measuring"),
])
def test_trial_outcome_refuses_an_unfinished_state(state):
    with pytest.raises(ValueError, match=f"not {state.value}"):
        TrialOutcome(state)


@pytest.mark.parametrize("state", [TrialState.DONE, TrialState.INFEASIBLE, TrialState.FAILED, "Done"])
def test_trial_outcome_takes_a_finished_state(state):
    assert TrialOutcome(state).state is TrialState(state)


def test_trial_outcome_never_ranks_nan_or_inf():
    assert TrialOutcome(TrialState.DONE, Verdict.MET, float("nan")).objective is None
    assert TrialOutcome(TrialState.DONE, Verdict.MET, float("inf")).objective is None
    assert TrialOutcome(TrialState.DONE, Verdict.MET, 1.0, {M.TTFT_MS: float("inf")}).metric(M.TTFT_MS) is None


SPACE_2GMU = SearchSpace((4, 8, 16), (90, 95))
SLO_ITL = SloTargets(itl_ms=50)


def _memory_pruned(*settings: Setting, memory_reason: Reason | None = Reason.KV_CACHE_TOO_SMALL) -> list[PrunedSetting]:
    return [PrunedSetting(s, Reason.DOES_NOT_FIT_MEMORY,
                          "does not fit in GPU memory: ValueError: No available memory for the cache blocks.", memory_reason)
            for s in settings]


@pytest.mark.parametrize("pruned, learned", [
    pytest.param(_memory_pruned(Setting(8, 90), Setting(16, 90)), [(Setting(8, 90), Reason.KV_CACHE_TOO_SMALL),
                                                                    (Setting(16, 90), Reason.KV_CACHE_TOO_SMALL)], id="kv"),
    pytest.param(_memory_pruned(Setting(16, 95), memory_reason=Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH),
                 [(Setting(16, 95), Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH)], id="gmu-too-high"),
    pytest.param(_memory_pruned(Setting(8, 90), memory_reason=None), [(Setting(8, 90), Reason.KV_CACHE_TOO_SMALL)],
                 id="unknown-memory-reason-is-kv"),
    pytest.param([PrunedSetting(Setting(8, 90), Reason.ENGINE_INVARIANT, "vLLM would refuse to start"),
                  PrunedSetting(Setting(16, 90), Reason.DOMINATED, "dominated")], [], id="not-memory"),
    pytest.param(_memory_pruned(Setting(32, 90)), [], id="outside-the-plan"),
])
def test_learned_from_pruned(pruned, learned):
    entries = learned_from_pruned(pruned, set(plan_candidates(SPACE_2GMU).candidates))
    assert [(s, o.reason) for s, o in entries] == learned
    for _, outcome in entries:
        assert outcome.state is TrialState.INFEASIBLE and not outcome.met and "No available memory" in outcome.message


def test_memory_pruned_settings_teach_the_strategy_without_spending_trials():
    pruned = _memory_pruned(Setting(8, 90), Setting(16, 90))
    search = Search.start("Adaptive", SPACE_2GMU, None, pruned, SLO_ITL, "SloCapacity", 0, 3)
    assert len(search.learned) == 2
    assert search.strategy.max_trials == 3 + 2  # what the prefilter taught is outside maxTrials
    met = TrialOutcome(TrialState.DONE, Verdict.MET, 2.0, {
        M.REQUEST_THROUGHPUT: 2.0, M.SLO_CAPACITY: 2.0, M.KV_CACHE_USAGE_PERCENT: 30.0, M.PREEMPTIONS_PER_SECOND: 0.0,
        M.TTFT_MS: 100.0, M.ITL_MS: 20.0, M.ERROR_RATE_PERCENT: 0.0})
    nxt = search.ask([(Setting(4, 90), met)])
    # The gmu-90% column ends where memory ran out, not at the SLO: more memory is worth a trial.
    assert nxt is not None and nxt.gpu_memory_utilization_percent == 95
    first = search.ask([])
    assert first is not None and first not in {p.setting for p in pruned}
    assert search.ask([], pending=[first]) != first


def test_search_is_rebuilt_the_same_from_the_same_inputs():
    pruned = _memory_pruned(Setting(16, 90))
    a = Search.start("Bayesian", SPACE_2GMU, None, pruned, SLO_ITL, "SloCapacity", 7, 4)
    b = Search.start("Bayesian", SPACE_2GMU, None, pruned, SLO_ITL, "SloCapacity", 7, 4)
    assert a.ask([]) == b.ask([]) and a.ask([]) != Setting(16, 90)


def test_search_keeps_engine_invariant_prunes_out_of_the_plan():
    invariant = lambda s: "refused" if s.max_num_seqs == 16 else None  # noqa: E731
    search = Search.start("Grid", SPACE_2GMU, invariant, [], SLO_ITL, "SloCapacity", 0, 64)
    asked, history = [], []
    while (s := search.ask(history)) is not None:
        asked.append(s)
        history.append((s, TrialOutcome(TrialState.DONE, Verdict.MET, 1.0)))
    assert len(asked) == 4 and all(s.max_num_seqs != 16 for s in asked)


# ---- batch_never_filled: a capacity trial KV-bound below its batch limit bounds its column ---------------------


def _kv_capacity_outcome(seqs: int, running_at_fail: float | None, *, peak_kv: float = 97.0, preempt: float = 0.0,
                         met: bool = True, failing_steps: int = 1) -> TrialOutcome:
    """A capacity trial: a passing step, then `failing_steps` failing ones with `running_at_fail` mean running."""
    from batchtune.core.outcomes import StepObservation

    fail_metrics = {} if running_at_fail is None else {M.RUNNING_REQUESTS: running_at_fail}
    steps = (StepObservation(seqs // 2, {M.RUNNING_REQUESTS: seqs / 2}, Verdict.MET, 0.2),
             *(StepObservation(seqs * (2 + i), fail_metrics, Verdict.VIOLATED, -0.5) for i in range(failing_steps)))
    metrics = {"e2eMs": 500.0, "sloCapacity": 10.0, "kvCacheUsagePercent": 60.0, "kvCacheUsagePeakPercent": peak_kv,
               "preemptionsPeakPerSecond": preempt}
    return TrialOutcome(TrialState.DONE, Verdict.MET if met else Verdict.VIOLATED, 10.0 if met else None, metrics,
                        steps=steps)


@pytest.mark.parametrize(("outcome", "bounds"), [
    pytest.param(_kv_capacity_outcome(100, 85.0), True, id="kv-full-batch-at-85pct-never-filled"),
    pytest.param(_kv_capacity_outcome(100, 89.9), True, id="just-under-90pct"),
    pytest.param(_kv_capacity_outcome(100, 90.0), False, id="90pct-filled"),
    pytest.param(_kv_capacity_outcome(100, 95.0), False, id="95pct-filled"),
    pytest.param(_kv_capacity_outcome(100, 40.0, peak_kv=60.0, preempt=0.5), True, id="preemptions-are-kv-bound"),
    pytest.param(_kv_capacity_outcome(100, 40.0, peak_kv=60.0), False, id="not-kv-bound"),
    pytest.param(_kv_capacity_outcome(100, 40.0, met=False), False, id="violated-trial"),
    pytest.param(_kv_capacity_outcome(100, 40.0, failing_steps=0), False, id="no-failing-step"),
    pytest.param(_kv_capacity_outcome(100, None), False, id="running-unmeasured-at-a-failing-step"),
])
def test_batch_never_filled(outcome, bounds):
    from batchtune.core.strategies._adaptive import batch_never_filled

    reason = batch_never_filled(Setting(100, 90), outcome)
    assert (reason is not None) is bounds
    if bounds:
        assert "batch never filled" in reason and "0.9 x max-num-seqs 100" in reason


def test_batch_never_filled_needs_every_failing_step_under_the_line():
    from batchtune.core.outcomes import StepObservation
    from batchtune.core.strategies._adaptive import batch_never_filled

    outcome = _kv_capacity_outcome(100, 50.0, failing_steps=2)
    one_full = TrialOutcome(outcome.state, outcome.verdict, outcome.objective, outcome.metrics,
                            steps=(*outcome.steps, StepObservation(900, {M.RUNNING_REQUESTS: 99.0}, Verdict.VIOLATED)))
    assert batch_never_filled(Setting(100, 90), outcome) is not None
    assert batch_never_filled(Setting(100, 90), one_full) is None


def _kv_world(s: Setting) -> TrialOutcome:
    """The KV cache holds 40 running requests at gmu 80 and 160 at gmu 90; every trial meets the SLO at its
    capacity, min(seqs, KV), and its failing step above the capacity runs that many."""
    kv = {80: 40, 90: 160}[s.gpu_memory_utilization_percent]
    running = float(min(s.max_num_seqs, kv))
    return _kv_capacity_outcome(s.max_num_seqs, running, peak_kv=97.0 if s.max_num_seqs > kv else 60.0)


def test_adaptive_stops_climbing_a_column_whose_batch_never_filled():
    plan = plan_candidates(SearchSpace(doublings(4, 512), (80, 90)))
    strategy = make_strategy("Adaptive", plan, SLO, "SloCapacity", 0, 64)
    history = []
    while (s := strategy.ask(history)) is not None:
        history.append((s, _kv_world(s)))
    at_80 = {s.max_num_seqs for s, _ in history if s.gpu_memory_utilization_percent == 80}
    assert max(at_80) <= 128 and 512 not in at_80  # 128 ran 40 of 128: nothing larger can help at gmu 80
    assert any(s.gpu_memory_utilization_percent == 90 for s, _ in history)  # KV-bound: more memory can
    skipped = strategy.skipped(history)
    assert any(p.setting == Setting(512, 80) and "batch never filled" in p.message for p in skipped)


def test_batch_never_filled_is_for_capacity_objectives_only():
    plan = plan_candidates(SearchSpace(doublings(4, 512), (80,)))
    strategy = make_strategy("Adaptive", plan, SLO, "OutputThroughput", 0, 64)
    history = []
    while (s := strategy.ask(history)) is not None:
        history.append((s, _kv_world(s)))
    assert 512 in {s.max_num_seqs for s, _ in history}
