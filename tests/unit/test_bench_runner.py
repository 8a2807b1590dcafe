"""The testbed bills what a tuning run spends; a seed fixes every figure; the CLI is wired."""

from __future__ import annotations

import json

import pytest

from batchtune.bench.runner import run_bench, run_scenario, summarize
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.synthetic import SyntheticTruth
from batchtune.bench.testbed import CostModel, SimTestbed, steady_warmup_seconds
from batchtune.bench.types import Knobs, Load, Reading, Slo
from batchtune.core.warmup import STEADY_MIN_S

SMALL = Scenario(
    name="small", summary="synthetic", model="Llama-3.1-8B", gpu="H100", input_len=512, output_len=128,
    slo=Slo({"p95_ttft_ms": 500.0, "p95_itl_ms": 30.0}),
    tuner_space=KnobGrid((8, 32, 128, 512), (90, 95, 98)),
    oracle_space=KnobGrid((8, 16, 32, 64, 128, 256, 512), (88, 90, 92, 95, 97, 98)),
    sim_window_s=15.0,  # billed as 60 s; TwinGuided's calibrations simulate every step measured, keep them short
)
TP2 = Scenario(
    name="tp2", summary="synthetic", model="Llama-3.1-70B", gpu="H100", input_len=512, output_len=128,
    slo=Slo({"p95_ttft_ms": 500.0}), tensor_parallel_size=2, measure_s=90.0,
)


NO_JOB_OVERHEAD = {"job_start_s": 0.0, "scrape_lag_s": 0.0}


def test_testbed_bills_startup_warmup_and_each_step_on_every_gpu() -> None:
    truth = SyntheticTruth(startup_s=100.0)
    testbed = SimTestbed(TP2, truth, seed=1, noise=0.0, cost=CostModel(warmup_s=30.0, **NO_JOB_OVERHEAD))
    assert testbed.start(Knobs(64, 90)).ok
    testbed.run_load(Load("request_rate", 1.0))
    second = testbed.run_load(Load("request_rate", 2.0))
    ledger = testbed.ledger
    assert (ledger.starts, ledger.load_steps) == (1, 2)
    settled = steady_warmup_seconds(second, 30.0)
    assert STEADY_MIN_S <= settled < 30.0
    # Every step is a load Job with its warm-up: the first in full, the second on the warm server until it settled.
    assert ledger.wall_seconds == pytest.approx(100 + 30 + 90 + settled + 90)
    assert ledger.gpu_seconds == pytest.approx(2 * ledger.wall_seconds)
    fixed = SimTestbed(TP2, truth, seed=1, noise=0.0, cost=CostModel(warmup_s=30.0, steady_warmup=False,
                                                                      **NO_JOB_OVERHEAD))
    assert fixed.start(Knobs(64, 90)).ok
    fixed.run_load(Load("request_rate", 1.0))
    fixed.run_load(Load("request_rate", 2.0))
    assert fixed.ledger.wall_seconds == pytest.approx(100 + 2 * (30 + 90))
    restarted = SimTestbed(TP2, truth, seed=1, noise=0.0, cost=CostModel(warmup_s=30.0, **NO_JOB_OVERHEAD))
    for _ in range(2):  # a new start is a cold server again
        assert restarted.start(Knobs(64, 90)).ok
        restarted.run_load(Load("request_rate", 1.0))
    assert restarted.ledger.wall_seconds == pytest.approx(2 * (100 + 30 + 90))


def test_testbed_bills_each_operator_run_its_job_start_and_scrape_lag() -> None:
    # As the operator runs each step: a Job created on a tick, its pod and load generator started, and after the
    # window the scrape lag before the run is read; a lengthened run is a run of its own, as long as it measures.
    truth = SyntheticTruth(startup_s=100.0)
    cost = CostModel(warmup_s=30.0, steady_warmup=False, job_start_s=5.0, scrape_lag_s=7.0)
    testbed = SimTestbed(TP2, truth, seed=1, noise=0.0, cost=cost)
    assert testbed.start(Knobs(64, 90)).ok
    testbed.run_load(Load("request_rate", 1.0))
    testbed.run_load(Load("request_rate", 1.0), seconds=270.0)
    assert testbed.ledger.wall_seconds == pytest.approx(100 + (5 + 30 + 90 + 7) + (5 + 30 + 270 + 7))
    prompts = SimTestbed(TP2, truth, seed=1, noise=0.0, cost=cost)
    assert prompts.start(Knobs(64, 90)).ok
    counted = prompts.run_load(Load("request_rate", 1.0), prompts=100)
    assert prompts.ledger.wall_seconds == pytest.approx(100 + counted.duration_s)  # vllm bench serve: none of it


@pytest.mark.parametrize("load, metrics, failure, expected", [
    pytest.param(Load("concurrency", 4), {"mean_e2el_ms": 840.0, "mean_ttft_ms": 60.0}, None, STEADY_MIN_S + 1,
                 id="closed-loop-at-the-minimum"),
    pytest.param(Load("concurrency", 64), {"mean_e2el_ms": 14_200.0, "mean_ttft_ms": 9000.0}, None, STEADY_MIN_S + 1,
                 id="closed-loop-queue-wait-does-not-delay"),
    pytest.param(Load("concurrency", 64), {"mean_e2el_ms": 24_000.0, "mean_ttft_ms": 1000.0}, None, 24.0,
                 id="closed-loop-first-completion"),
    pytest.param(Load("concurrency", 64), {"mean_e2el_ms": 44_000.0, "mean_ttft_ms": 1000.0}, None, 30.0,
                 id="capped"),
    pytest.param(Load("request_rate", 50.0), {"mean_e2el_ms": 900.0, "request_throughput": 49.0, "duration": 60.0},
                 None, 10.0, id="open-loop-busy-little-noise"),
    pytest.param(Load("request_rate", 5.0), {"mean_e2el_ms": 900.0, "request_throughput": 4.8, "duration": 60.0},
                 None, 15.0, id="open-loop-quiet-noisier"),
    pytest.param(Load("request_rate", 25.0), {"mean_e2el_ms": 8200.0, "request_throughput": 8.9, "duration": 60.0},
                 None, 30.0, id="open-loop-above-capacity"),
    pytest.param(Load("request_rate", 5.0), {"request_throughput": 4.8}, None, 30.0, id="no-latency"),
    pytest.param(Load("concurrency", 4), {"mean_e2el_ms": 840.0}, "CUDA out of memory", 30.0, id="failed"),
])  # fmt: skip
def test_steady_warmup_seconds(load: Load, metrics: dict[str, float], failure: str | None, expected: float) -> None:
    assert steady_warmup_seconds(Reading(load, metrics, failure), 30.0) == pytest.approx(expected)


def test_failed_starts_cost_their_time_and_leave_no_server() -> None:
    testbed = SimTestbed(SMALL, SyntheticTruth(memory_gib=10.0), seed=1, noise=0.0)
    result = testbed.start(Knobs(64, 50))
    assert not result.ok and testbed.ledger.failed_starts == 1
    assert testbed.ledger.wall_seconds == pytest.approx(result.seconds)
    with pytest.raises(RuntimeError, match="start"):
        testbed.run_load(Load("request_rate", 1.0))


def test_a_runtime_oom_kills_the_server() -> None:
    testbed = SimTestbed(SMALL, SyntheticTruth(), seed=1, noise=0.0)
    assert testbed.start(Knobs(64, 98, 16384)).ok
    assert not testbed.run_load(Load("request_rate", 1.0)).ok
    assert testbed.running is None and testbed.ledger.runtime_failures == 1


def test_noisy_readings_depend_on_the_seed_only() -> None:
    def reading(seed: int) -> float:
        testbed = SimTestbed(SMALL, SyntheticTruth(), seed=seed, noise=0.05)
        testbed.start(Knobs(64, 90))
        return testbed.run_load(Load("request_rate", 3.0)).get("p95_ttft_ms")

    assert reading(7) == reading(7)
    assert reading(7) != reading(8)


# Two whole scenario runs of every strategy: 16 s alone, 79 s beside the cold Go build (fresh-machine CI, 7 Dec).
@pytest.mark.timeout(600)
def test_a_scenario_run_is_deterministic_for_a_seed() -> None:
    first = run_scenario(SMALL, SyntheticTruth(), seed=11, noise=0.03)
    again = run_scenario(SMALL, SyntheticTruth(), seed=11, noise=0.03)
    strip = lambda r: [{k: v for k, v in run.__dict__.items()} for run in r.runs]  # noqa: E731
    assert strip(first) == strip(again)
    assert first.oracle_setting == again.oracle_setting


def test_every_strategy_is_judged_against_an_oracle_at_least_as_good() -> None:
    result = run_scenario(SMALL, SyntheticTruth(), seed=2, noise=0.03)
    names = [r.strategy for r in result.runs]
    assert names == ["twin_guided", "adaptive", "adaptive_full_windows", "bayesian", "sim_only", "auto_tune",
                     "doubling", "hill_climb", "optuna_tpe"]
    for run in result.runs:
        assert 0.0 <= run.regret <= 1.0
        assert run.objective <= result.oracle_objective * (1 + 1e-9)
        if run.strategy == "sim_only":
            assert run.gpu_minutes == 0 and run.trials == 0  # it picks from the nominal twin, no trial
        else:
            assert run.gpu_minutes > 0 and run.trials >= 1
    adaptive = next(r for r in result.runs if r.strategy == "adaptive")
    tpe = next(r for r in result.runs if r.strategy == "optuna_tpe")
    assert tpe.trials == adaptive.trials  # same budget as ours


def test_summary_ratios_are_against_auto_tune() -> None:
    bench = run_bench([SMALL], SyntheticTruth, seed=4, noise=0.03)
    by_name = {s.strategy: s for s in bench.summary}
    assert by_name["auto_tune"].median_gpu_minutes_ratio == pytest.approx(1.0)
    sc = bench.scenarios[0]
    base = next(r for r in sc.runs if r.strategy == "auto_tune").gpu_minutes
    ours = next(r for r in sc.runs if r.strategy == "adaptive").gpu_minutes
    assert by_name["adaptive"].median_gpu_minutes_ratio == pytest.approx(ours / base)
    assert json.loads(json.dumps(bench.to_json()))["scenarios"][0]["scenario"] == "small"
    assert summarize(bench.scenarios) == bench.summary
    regrets = {r.strategy: r.regret for r in sc.runs}
    for name, summary in by_name.items():
        assert summary.within_1pct == int(regrets[name] <= 0.01 + 1e-9)
        assert summary.within_3pct == int(regrets[name] <= 0.03 + 1e-9)
    assert by_name["adaptive"].cheaper_than_reference is None
    guided = next(r for r in sc.runs if r.strategy == "twin_guided").gpu_minutes
    assert by_name["twin_guided"].cheaper_than_reference == int(guided < ours)


def test_a_saved_result_renders_again_with_the_same_summary(tmp_path, capsys) -> None:
    from batchtune.bench.report import to_json
    from batchtune.bench.runner import load_result
    from batchtune.cli import main

    bench = run_bench([SMALL], SyntheticTruth, seed=4, noise=0.03)
    saved = tmp_path / "bench.json"
    saved.write_text(to_json(bench))
    loaded = load_result(json.loads(saved.read_text()))
    assert loaded.summary == bench.summary and loaded.scenarios == bench.scenarios
    assert main(["bench", "tuning", "--render", str(saved), "-o", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "| twin_guided |" in out and "regret <= 1%" in out and "GPU-min < adaptive" in out
    if any(r.predictions for r in bench.scenarios[0].runs):
        assert "Predicted against measured" in out
    assert main(["bench", "tuning", "--render", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_cli_lists_scenarios_and_rejects_unknown_names(capsys) -> None:
    from batchtune.cli import main

    assert main(["bench", "tuning", "--list", "--quick"]) == 0
    assert "oom-8b-h100-bigbudget" in capsys.readouterr().out
    assert main(["bench", "tuning", "--scenarios", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_strategy_names_are_the_ones_the_results_carry() -> None:
    from batchtune.bench.runner import STRATEGY_NAMES, TPE_NAME, _name, default_strategies

    assert (*(_name(s) for s in default_strategies(SyntheticTruth())), TPE_NAME) == STRATEGY_NAMES


def test_cli_runs_only_the_strategies_named_and_refuses_an_unknown_one(capsys) -> None:
    from batchtune.bench.runner import OnlyStrategies
    from batchtune.cli import main

    bench = run_bench([SMALL], SyntheticTruth, seed=4, noise=0.03,
                      strategies=OnlyStrategies(frozenset({"adaptive", "doubling"})), with_tpe=False)
    assert [r.strategy for r in bench.scenarios[0].runs] == ["adaptive", "doubling"]
    assert main(["bench", "tuning", "--strategies", "adaptive,nope"]) == 2
    err = capsys.readouterr().err
    assert "--strategies 'adaptive,nope'" in err and "'nope'" in err and "twin_guided" in err
