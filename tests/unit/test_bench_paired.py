"""Paired comparison with confidence over scenario x seed cases, and per-strategy regret distributions."""

from __future__ import annotations

import math

import pytest

from batchtune.bench.paired import (
    bootstrap_ci,
    distributions,
    paired_comparisons,
    quantile,
    sign_test_p,
)
from batchtune.bench.runner import ScenarioResult, StrategyRun


def run(strategy: str, regret: float, *, chosen: bool = True, violates: bool = False,
        unsafe: bool = False) -> StrategyRun:
    return StrategyRun(strategy=strategy, chosen="mns8/gmu90" if chosen else None, chosen_knobs=None,
                       claimed_load=None, objective=1.0 - regret, regret=regret, violates=violates,
                       noisy_violations=0, trials=1, failed_starts=0, load_steps=1, gpu_minutes=1.0, note="",
                       unsafe=unsafe)


def case(name: str, seed: int, *runs: StrategyRun) -> ScenarioResult:
    return ScenarioResult(scenario=name, summary="", tags=(), objective_unit="req/s", oracle_setting="mns8/gmu90",
                          oracle_objective=1.0, oracle_grid=1, oracle_feasible=1, tuner_grid_best=1.0,
                          best_gmu_below_max=False, saturation_preemptions_per_s=0.0, runs=runs, seconds=0.0,
                          truth_seed=seed)


def test_the_sign_test_is_the_exact_two_sided_binomial() -> None:
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)
    assert sign_test_p(0, 5) == sign_test_p(5, 0)
    assert sign_test_p(4, 3) == 1.0
    # 10 of 12: 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12 (scipy.stats.binomtest gives 0.0386).
    assert sign_test_p(10, 2) == pytest.approx(2 * 79 / 4096)
    assert sign_test_p(6, 6) == 1.0
    with pytest.raises(ValueError):
        sign_test_p(-1, 2)


def test_quantiles_interpolate_like_numpy_and_the_bootstrap_is_seeded() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.9) == pytest.approx(3.7)
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert bootstrap_ci([0.2] * 7) == pytest.approx((0.2, 0.2))
    values = [0.0, 0.01, 0.02, 0.05, 0.1, 0.3]
    low, high = bootstrap_ci(values, seed=1)
    assert low < sum(values) / len(values) < high
    assert bootstrap_ci(values, seed=1) == (low, high)
    assert low >= 0.0 and high <= 0.3
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_the_default_is_paired_with_each_other_strategy_case_by_case() -> None:
    results = [case("s", seed, run("adaptive", 0.0), run("hill_climb", 0.1), run("doubling", 0.0))
               for seed in range(1, 6)]
    results.append(case("s", 6, run("adaptive", 0.02), run("hill_climb", 0.02), run("doubling", 0.0)))
    by_other = {c.other: c for c in paired_comparisons(results)}
    assert set(by_other) == {"hill_climb", "doubling"}
    hill = by_other["hill_climb"]
    assert (hill.cases, hill.default_better, hill.other_better, hill.ties) == (6, 5, 0, 1)
    assert hill.mean_difference == pytest.approx(0.5 / 6)
    assert hill.sign_test_p == pytest.approx(2 / 32)
    assert 0.0 < hill.ci_low <= hill.mean_difference <= hill.ci_high
    doubling = by_other["doubling"]
    assert (doubling.default_better, doubling.other_better, doubling.ties) == (0, 1, 5)
    assert doubling.mean_difference < 0 and doubling.sign_test_p == 1.0


def test_each_strategy_has_its_regret_distribution_and_its_bad_choices_counted() -> None:
    regrets = [0.0, 0.005, 0.02, 0.05, 0.5]
    results = [case("s", i, run("adaptive", r)) for i, r in enumerate(regrets, 1)]
    results.append(case("t", 1, run("adaptive", 1.0, chosen=False)))
    results.append(case("u", 1, run("adaptive", 0.01, violates=True, unsafe=True)))
    (dist,) = distributions(results)
    values = regrets + [1.0, 0.01]
    assert dist.cases == 7
    assert dist.median == pytest.approx(quantile(values, 0.5)) == pytest.approx(0.02)
    assert dist.p90 == pytest.approx(quantile(values, 0.9))
    assert dist.max == 1.0
    assert (dist.within_1pct, dist.within_3pct) == (3, 4)
    assert (dist.violating, dist.no_choice, dist.unsafe) == (1, 1, 1)


def test_the_judge_marks_a_choice_a_full_burst_crashes_as_unsafe() -> None:
    from dataclasses import dataclass

    from batchtune.bench.evaluate import Judge
    from batchtune.bench.oracle import run_oracle
    from batchtune.bench.runner import _judge_choice
    from batchtune.bench.scenarios import KnobGrid, Scenario
    from batchtune.bench.synthetic import SyntheticTruth
    from batchtune.bench.testbed import SimTestbed
    from batchtune.bench.types import Choice, Knobs, Load, Slo

    @dataclass(frozen=True)
    class BurstTruth(SyntheticTruth):
        def burst_failure(self, scenario: object, knobs: Knobs) -> str | None:
            return "torch.OutOfMemoryError: burst" if knobs.max_num_seqs >= 128 else None

    tiny = Scenario(name="tiny", summary="synthetic", model="Llama-3.1-8B", gpu="H100", input_len=512, output_len=128,
                    slo=Slo({"p95_ttft_ms": 500.0}), tuner_space=KnobGrid((8, 128), (90,)),
                    oracle_space=KnobGrid((8, 128), (90,)), sim_window_s=10.0)
    judge = Judge(tiny, BurstTruth())
    oracle = run_oracle(judge)
    testbed = SimTestbed(tiny, BurstTruth(), seed=0, noise=0.0)
    load = Load("request_rate", 1.0)
    safe = _judge_choice(judge, oracle, "a", Choice(Knobs(8, 90), load), testbed, 0, 0.0)
    unsafe = _judge_choice(judge, oracle, "b", Choice(Knobs(128, 90), load), testbed, 0, 0.0)
    assert not safe.unsafe and unsafe.unsafe
    # The judge applies the runtime-OOM rule to every choice: an unsafe one is a violation, whatever it holds.
    assert unsafe.violates and not safe.violates
    assert unsafe.regret == 1.0  # the oracle already scores a burst crash 0


def test_the_markdown_leads_with_the_distributions_and_the_paired_comparison() -> None:
    from batchtune.bench.report import markdown
    from batchtune.bench.runner import BenchResult, summarize

    results = tuple(case("s", seed, run("adaptive", 0.0), run("hill_climb", 0.1)) for seed in range(1, 6))
    text = markdown(BenchResult(seed=0, noise=0.0, scenarios=results, summary=summarize(results), seconds=0.0,
                                truth_seeds=(1, 2, 3, 4, 5)))
    assert "### Regret per strategy over the cases" in text
    assert "| adaptive | hill_climb | 5 | 5 / 0 / 0 | +10.0% | [+10.0%, +10.0%] | 0.0625 |" in text
    # Policy regret beside the raw regret (these hand-made cases record no policy pick: 0 policy regret).
    assert ("| hill_climb | 5 | 0.0% / 0.0% / 0.0% | 5/5 | 5/5 | 10.0% / 10.0% / 10.0% | 0/5 | 0/5 | 0 | 0 | 0 |"
            in text)
