"""Each baseline's logic on scripted evaluators: what it tries, where it stops, what it picks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import optuna
import pytest

import batchtune.bench.evaluate as evaluate
from batchtune.bench.evaluate import TrialResult
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.strategies.autotune import AutoTune, rate_step
from batchtune.bench.strategies.doubling import Doubling
from batchtune.bench.strategies.hillclimb import HillClimb
from batchtune.bench.strategies.prefilter import PRUNED
from batchtune.bench.strategies.tpe import OptunaTpe, startup_trials
from batchtune.bench.testbed import SimTestbed
from batchtune.bench.types import Knobs, Load, Reading, Slo, StartResult


def scenario(mns: tuple[int, ...] = (8, 16, 32, 64, 128), gmu: tuple[int, ...] = (85, 90, 95, 98)) -> Scenario:
    return Scenario(
        name="scripted", summary="scripted", model="Llama-3.1-8B", gpu="H100", input_len=100, output_len=10,
        slo=Slo({"p99_e2el_ms": 2000.0}), tuner_space=KnobGrid(mns, gmu),
    )


@dataclass
class AutoTuneTruth:
    """gmu above 95 does not start; rate=inf gives `inf_throughput` req/s over the limit; rates <= `passing` pass."""

    passing: float = 7.0
    inf_passes: bool = False
    inf_throughput: float = 10.4
    starts: list[Knobs] = field(default_factory=list)
    loads: list[tuple[float, int | None]] = field(default_factory=list)

    def startup(self, scenario, knobs: Knobs) -> StartResult:
        self.starts.append(knobs)
        if knobs.gpu_memory_utilization_pct > 95:
            return StartResult(False, 20.0, "Free memory on device cuda:0 is less than desired")
        return StartResult(True, 60.0)

    def measure(self, scenario, knobs, load: Load, *, duration_s, seed, noise, prompts=None, warmup_s=None) -> Reading:
        self.loads.append((load.value, prompts))
        if math.isinf(load.value):
            e2el = 1000.0 if self.inf_passes else 5000.0
            return Reading(load, {"request_throughput": self.inf_throughput, "p99_e2el_ms": e2el, "duration": 96.0,
                                  "completed": float(prompts or 0)})
        e2el = 1000.0 if load.value <= self.passing else 5000.0
        return Reading(load, {"request_throughput": load.value, "p99_e2el_ms": e2el})


def test_auto_tune_probes_memory_down_from_98_and_steps_the_rate_down_to_the_first_pass() -> None:
    truth = AutoTuneTruth(passing=7.0)
    sc = scenario(mns=(64,), gmu=(90,))
    testbed = SimTestbed(sc, truth, seed=0, noise=0.0)
    choice = AutoTune().tune(testbed, sc, seed=0)
    probe = [k.gpu_memory_utilization_pct for k in truth.starts[:4]]
    assert probe == [98, 97, 96, 95]
    assert choice.knobs == Knobs(64, 95)
    assert choice.claimed_load == Load("request_rate", 7.0)
    # 1000 prompts at rate inf, then 100 prompts at int(10.4)+1 = 11, 10, 9, 8, 7 and no further.
    assert truth.loads[0] == (math.inf, 1000)
    assert truth.loads[1:] == [(11.0, 100), (10.0, 100), (9.0, 100), (8.0, 100), (7.0, 100)]
    assert testbed.ledger.starts == 5 and testbed.ledger.failed_starts == 3


def test_auto_tune_steps_down_finer_than_1_req_s_below_its_capacity_of_1() -> None:
    # The script's integer step would try 1 req/s and stop at 0: a 0.35 req/s capacity needs a finer step.
    truth = AutoTuneTruth(passing=0.35, inf_throughput=0.6)
    sc = scenario(mns=(64,), gmu=(90,))
    choice = AutoTune().tune(SimTestbed(sc, truth, seed=0, noise=0.0), sc, seed=0)
    assert choice.knobs == Knobs(64, 95)
    assert choice.claimed_load == Load("request_rate", 0.35)
    # Step 0.05 (ten steps below 0.6), from one step above the rate=inf throughput; still 100 prompts each.
    assert truth.loads[1:] == [(0.65, 100), (0.6, 100), (0.55, 100), (0.5, 100), (0.45, 100), (0.4, 100),
                               (0.35, 100)]


def test_auto_tune_steps_half_a_request_below_10_req_s() -> None:
    truth = AutoTuneTruth(passing=4.5, inf_throughput=5.2)
    sc = scenario(mns=(64,), gmu=(90,))
    choice = AutoTune().tune(SimTestbed(sc, truth, seed=0, noise=0.0), sc, seed=0)
    assert choice.claimed_load == Load("request_rate", 4.5)  # the integer step would have claimed 4
    assert truth.loads[1:] == [(5.5, 100), (5.0, 100), (4.5, 100)]


@pytest.mark.parametrize(("throughput", "step"), [
    (10.4, 1.0), (10.0, 1.0), (9.99, 0.5), (5.0, 0.5), (4.99, 0.2), (2.0, 0.2), (1.0, 0.1), (0.6, 0.05), (0.0, 1.0),
])
def test_auto_tune_rate_step_puts_ten_steps_below_the_rate_inf_throughput(throughput: float, step: float) -> None:
    assert rate_step(throughput) == step


def test_auto_tune_keeps_rate_inf_when_it_already_meets_the_limit() -> None:
    truth = AutoTuneTruth(inf_passes=True)
    sc = scenario(mns=(64,), gmu=(90,))
    choice = AutoTune().tune(SimTestbed(sc, truth, seed=0, noise=0.0), sc, seed=0)
    assert len(truth.loads) == 1
    assert choice.claimed_load == Load("request_rate", 10.4)


def test_auto_tune_runs_every_cell_and_keeps_the_highest_throughput() -> None:
    truth = AutoTuneTruth(passing=3.0)
    sc = Scenario(
        name="cells", summary="", model="Llama-3.1-8B", gpu="H100", input_len=100, output_len=10,
        slo=Slo({"p99_e2el_ms": 2000.0}), tuner_space=KnobGrid((32, 64), (90,), (2048, 4096)),
    )
    AutoTune().tune(SimTestbed(sc, truth, seed=0, noise=0.0), sc, seed=0)
    cells = [(k.max_num_seqs, k.max_num_batched_tokens) for k in truth.starts if k.gpu_memory_utilization_pct == 95]
    # The probe uses the largest cell; then every (seqs, tokens) cell starts once.
    assert cells == [(64, 4096), (32, 2048), (32, 4096), (64, 2048), (64, 4096)]


def test_auto_tune_gives_up_when_no_gmu_down_to_90_starts() -> None:
    class NeverStarts(AutoTuneTruth):
        def startup(self, scenario, knobs):
            self.starts.append(knobs)
            return StartResult(False, 20.0, "No available memory for the cache blocks.")

    truth = NeverStarts()
    sc = scenario(mns=(64,), gmu=(90,))
    choice = AutoTune().tune(SimTestbed(sc, truth, seed=0, noise=0.0), sc, seed=0)
    assert choice.knobs is None
    assert [k.gpu_memory_utilization_pct for k in truth.starts] == list(range(98, 89, -1))


@pytest.fixture
def scripted_trials(monkeypatch):
    """Replace the operator trial with a table: knobs -> objective (None: SLO violated)."""
    table: dict[Knobs, float | None] = {}
    tried: list[Knobs] = []

    def fake_trial(testbed, scenario, knobs, *, protocol=None, neighbours=(), predicted=None):
        tried.append(knobs)
        value = table.get(knobs)
        met = value is not None
        load = Load("request_rate", value) if met else None
        return TrialResult(knobs, True, value or 0.0, met, load, None)

    monkeypatch.setattr(evaluate, "operator_trial", fake_trial)
    return table, tried


def _testbed(sc: Scenario) -> SimTestbed:
    return SimTestbed(sc, AutoTuneTruth(), seed=0, noise=0.0)


def test_doubling_stops_at_the_knee_and_takes_the_one_before(scripted_trials) -> None:
    table, tried = scripted_trials
    table.update({Knobs(8, 90): 10.0, Knobs(16, 90): 19.0, Knobs(32, 90): 30.0, Knobs(64, 90): 31.0,
                  Knobs(128, 90): 60.0})
    sc = scenario()
    choice = Doubling().tune(_testbed(sc), sc, seed=0)
    assert [k.max_num_seqs for k in tried] == [8, 16, 32, 64]  # 32 -> 64 gains 3% < 10%: the knee
    assert choice.knobs == Knobs(32, 90)


def test_doubling_stops_when_the_slo_breaks(scripted_trials) -> None:
    table, tried = scripted_trials
    table.update({Knobs(8, 90): 10.0, Knobs(16, 90): 19.0, Knobs(32, 90): None})
    sc = scenario()
    choice = Doubling().tune(_testbed(sc), sc, seed=0)
    assert [k.max_num_seqs for k in tried] == [8, 16, 32]
    assert choice.knobs == Knobs(16, 90)


def test_doubling_reports_nothing_when_the_first_batch_fails(scripted_trials) -> None:
    sc = scenario()
    assert Doubling().tune(_testbed(sc), sc, seed=0).knobs is None


def test_hill_climb_doubles_the_batch_then_steps_gmu_while_it_improves(scripted_trials) -> None:
    table, tried = scripted_trials
    for mns, value in ((8, 10.0), (16, 18.0), (32, 25.0), (64, 25.1), (128, 20.0)):
        table[Knobs(mns, 90)] = value
    table[Knobs(32, 95)] = 28.0
    table[Knobs(32, 98)] = None  # out of memory: stop climbing gmu
    table[Knobs(64, 95)] = 28.1  # phase 3: less than 1% better, not a step uphill
    sc = scenario()
    choice = HillClimb().tune(_testbed(sc), sc, seed=0)
    assert tried == [Knobs(8, 90), Knobs(16, 90), Knobs(32, 90), Knobs(64, 90), Knobs(32, 95), Knobs(32, 98),
                     Knobs(64, 95)]
    assert choice.knobs == Knobs(32, 95)


def test_hill_climb_steps_gmu_down_when_up_does_not_help(scripted_trials) -> None:
    table, tried = scripted_trials
    table.update({Knobs(8, 90): 10.0, Knobs(16, 90): 9.0, Knobs(8, 95): 9.0, Knobs(8, 85): 12.0})
    sc = scenario()
    choice = HillClimb().tune(_testbed(sc), sc, seed=0)
    assert Knobs(8, 85) in tried
    assert choice.knobs == Knobs(8, 85)


def test_optuna_tpe_spends_exactly_its_budget_and_picks_its_best_met_trial(scripted_trials) -> None:
    table, tried = scripted_trials
    sc = scenario()
    for knobs in sc.tuner_space.grid():
        table[knobs] = float(knobs.max_num_seqs) if knobs.gpu_memory_utilization_pct < 98 else None
    choice = OptunaTpe(budget=7).tune(_testbed(sc), sc, seed=3)
    assert len(tried) == 7
    best = max((k for k in tried if table[k] is not None), key=lambda k: table[k])
    assert choice.knobs is not None and table[choice.knobs] == table[best]


def test_optuna_tpe_is_deterministic_for_a_seed(scripted_trials) -> None:
    table, tried = scripted_trials
    sc = scenario()
    for knobs in sc.tuner_space.grid():
        table[knobs] = float(knobs.max_num_seqs)
    OptunaTpe(budget=6).tune(_testbed(sc), sc, seed=5)
    first = list(tried)
    tried.clear()
    OptunaTpe(budget=6).tune(_testbed(sc), sc, seed=5)
    assert tried == first


def test_optuna_tpe_models_within_its_budget(scripted_trials, monkeypatch) -> None:
    # Optuna's default n_startup_trials=10 made every trial of a 4-13 trial budget a random one.
    made: list[dict[str, object]] = []
    real = optuna.samplers.TPESampler

    def recording(**kwargs):
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(optuna.samplers, "TPESampler", recording)
    table, _ = scripted_trials
    sc = scenario()
    for knobs in sc.tuner_space.grid():
        table[knobs] = float(knobs.max_num_seqs)
    OptunaTpe(budget=7).tune(_testbed(sc), sc, seed=1)
    assert made == [{"seed": 1, "n_startup_trials": 3, "multivariate": True}]
    assert [startup_trials(b) for b in (1, 4, 6, 7, 13, 30, 60)] == [2, 2, 2, 3, 5, 10, 10]


def test_optuna_tpe_reruns_a_resampled_setting_as_a_new_billed_trial(scripted_trials) -> None:
    table, tried = scripted_trials
    sc = scenario(mns=(8, 16), gmu=(90,))
    table.update({Knobs(8, 90): 5.0, Knobs(16, 90): 9.0})
    choice = OptunaTpe(budget=5).tune(_testbed(sc), sc, seed=0)
    assert len(tried) == 5 and len(set(tried)) <= 2  # two settings, five trials: three or more reruns
    assert f"({5 - len(set(tried))} resampled a seen setting)" in choice.note


def _refuse(predicate):
    def fits(scenario, knobs):
        return (False, "No available memory for the cache blocks.") if predicate(knobs) else (True, "")

    return fits


def test_optuna_tpe_skips_what_the_prefilter_prunes_unbilled_and_outside_its_budget(scripted_trials) -> None:
    table, tried = scripted_trials
    sc = scenario()
    for knobs in sc.tuner_space.grid():
        table[knobs] = float(knobs.max_num_seqs)
    testbed = _testbed(sc)
    choice = OptunaTpe(budget=8, fits=_refuse(lambda k: k.gpu_memory_utilization_pct >= 95)).tune(testbed, sc, seed=2)
    assert len(tried) == 8
    assert all(k.gpu_memory_utilization_pct < 95 for k in tried)
    assert "asks pruned unbilled" in choice.note  # half the grid is pruned: TPE asked some of it


def test_doubling_stops_unbilled_at_a_batch_the_prefilter_prunes(scripted_trials) -> None:
    table, tried = scripted_trials
    table.update({Knobs(8, 90): 10.0, Knobs(16, 90): 19.0, Knobs(32, 90): 30.0, Knobs(64, 90): 60.0})
    sc = scenario()
    testbed = _testbed(sc)
    choice = Doubling(fits=_refuse(lambda k: k.max_num_seqs >= 32)).tune(testbed, sc, seed=0)
    assert [k.max_num_seqs for k in tried] == [8, 16]  # 32 never started
    assert choice.knobs == Knobs(16, 90)


def test_hill_climb_does_not_start_a_setting_the_prefilter_prunes(scripted_trials) -> None:
    table, tried = scripted_trials
    for mns, value in ((8, 10.0), (16, 18.0), (32, 25.0), (64, 25.1)):
        table[Knobs(mns, 90)] = value
    table[Knobs(32, 95)] = 28.0
    sc = scenario()
    choice = HillClimb(fits=_refuse(lambda k: k.gpu_memory_utilization_pct >= 95)).tune(_testbed(sc), sc, seed=0)
    # gmu 95 pruned: the memory phase turns down at once; nothing at gmu >= 95 is started.
    assert tried == [Knobs(8, 90), Knobs(16, 90), Knobs(32, 90), Knobs(64, 90), Knobs(32, 85)]
    assert choice.knobs == Knobs(32, 90)
    assert "1 pruned unbilled" in choice.note


def test_the_prefilter_is_the_plan_ours_use() -> None:
    """The engine's invariant and the estimator prune exactly what `ours.plan_for` prunes, and a setting off the
    tuner grid is planned the same way."""
    from batchtune.bench.strategies.ours import knobs_of, plan_for
    from batchtune.bench.strategies.prefilter import Prefilter

    sc = Scenario(
        name="plan", summary="", model="Llama-3.1-8B", gpu="H100", input_len=100, output_len=10,
        slo=Slo({"p99_e2el_ms": 2000.0}), tuner_space=KnobGrid((8, 64, 1024), (90, 98), (512, 4096)),
    )
    fits = _refuse(lambda k: k.gpu_memory_utilization_pct == 98 and k.max_num_seqs == 8)
    prefilter = Prefilter(sc, fits)
    _, _, plan = plan_for(sc, fits)
    assert {knobs_of(p.setting) for p in plan.pruned} == {k for k in sc.tuner_space.grid() if prefilter.refuses(k)}
    assert prefilter.refuses(Knobs(1024, 90, 512))  # vLLM refuses max-num-batched-tokens < max-num-seqs
    assert prefilter.refuses(Knobs(8, 98, 512))
    assert prefilter.refuses(Knobs(8, 98, 2048))  # off the grid: planned alone
    assert prefilter.refuses(Knobs(16, 90, 4096)) is None
    skipped = prefilter.skipped(Knobs(8, 98, 512))
    assert skipped is not None and not skipped.started and not skipped.met and PRUNED in (skipped.failure or "")
    assert Prefilter(sc, None).refuses(Knobs(8, 98, 512)) is None


def test_the_bench_offers_the_prefilter_to_every_operator_style_baseline() -> None:
    from batchtune.bench.runner import default_strategies
    from batchtune.bench.twin_truth import TwinTruth

    strategies = {getattr(s, "label", None) or s.name: s for s in default_strategies(TwinTruth())}
    for name in ("doubling", "hill_climb", "adaptive", "twin_guided", "bayesian"):
        assert getattr(strategies[name], "fits", None) is not None, name
    assert not hasattr(strategies["auto_tune"], "fits")  # the script has its own memory probe (docs/benchmarks.md)
