"""Each baseline's logic on scripted evaluators: what it tries, where it stops, what it picks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

import batchtune.bench.evaluate as evaluate
from batchtune.bench.evaluate import TrialResult
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.strategies.autotune import AutoTune
from batchtune.bench.strategies.doubling import Doubling
from batchtune.bench.strategies.hillclimb import HillClimb
from batchtune.bench.strategies.tpe import OptunaTpe
from batchtune.bench.testbed import SimTestbed
from batchtune.bench.types import Knobs, Load, Reading, Slo, StartResult


def scenario(mns: tuple[int, ...] = (8, 16, 32, 64, 128), gmu: tuple[int, ...] = (85, 90, 95, 98)) -> Scenario:
    return Scenario(
        name="scripted", summary="scripted", model="Llama-3.1-8B", gpu="H100", input_len=100, output_len=10,
        slo=Slo({"p99_e2el_ms": 2000.0}), tuner_space=KnobGrid(mns, gmu),
    )


@dataclass
class AutoTuneTruth:
    """gmu above 95 does not start; rate=inf gives 10.4 req/s over the limit; rates <= `passing` pass."""

    passing: float = 7.0
    inf_passes: bool = False
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
            return Reading(load, {"request_throughput": 10.4, "p99_e2el_ms": e2el, "duration": 96.0,
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
