"""Held-out truth seeds: a result is reported on realities the rules were not developed on, and says which."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from bench_fixtures import TINY

from batchtune.bench.runner import BenchResult, load_result, run_bench
from batchtune.bench.seeds import (
    DEVELOPMENT_TRUTH_SEEDS,
    REPORTING_TRUTH_SEEDS,
    format_seeds,
    held_out,
    parse_truth_seeds,
)
from batchtune.bench.strategies.base import TuningStrategy
from batchtune.bench.strategies.doubling import Doubling
from batchtune.bench.strategies.hillclimb import HillClimb
from batchtune.bench.synthetic import SyntheticTruth


@dataclass(frozen=True)
class SeededTruth(SyntheticTruth):
    """A synthetic reality per truth seed: each seed's steps are slower by 5 % more."""

    truth_seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_base_ms", 8.0 * (1.0 + 0.05 * self.truth_seed))


def cheap(truth: object) -> list[TuningStrategy]:
    """Two baselines without a twin: the runner's bookkeeping is what is under test, not the strategies."""
    return [Doubling(), HillClimb()]


def bench(seeds: tuple[int, ...]) -> BenchResult:
    return run_bench([TINY], SeededTruth, seed=3, noise=0.0, truth_seeds=seeds, truth_name="perturbed",
                     strategies=cheap, with_tpe=False)


def test_truth_seed_sets_parse_and_the_development_set_is_apart() -> None:
    assert parse_truth_seeds("6-10") == (6, 7, 8, 9, 10) == REPORTING_TRUTH_SEEDS
    assert parse_truth_seeds("3, 1,7-8,1") == (1, 3, 7, 8)
    assert format_seeds((1, 2, 3, 5, 7, 8)) == "1-3,5,7-8"
    for bad in ("", "x", "5-1", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_truth_seeds(bad)
    # Seeds 1-5 were read to write rules (7 Dec): they joined the development set and report nothing.
    assert DEVELOPMENT_TRUTH_SEEDS == (0, 1, 2, 3, 4, 5)
    assert held_out(REPORTING_TRUTH_SEEDS) and not held_out((0, 1)) and not held_out((5, 6))


def test_the_cli_help_states_the_seed_sets_the_code_uses() -> None:
    from batchtune.cli.bench import DEVELOPMENT_SEEDS_HELP, REPORTING_SEEDS_HELP

    assert parse_truth_seeds(REPORTING_SEEDS_HELP) == REPORTING_TRUTH_SEEDS
    assert parse_truth_seeds(DEVELOPMENT_SEEDS_HELP) == DEVELOPMENT_TRUTH_SEEDS


def test_every_scenario_is_judged_on_every_truth_seed_and_the_result_records_them() -> None:
    from batchtune.bench.report import markdown, to_json

    result = bench((6, 7))
    assert [(r.scenario, r.truth_seed) for r in result.scenarios] == [("tiny", 6), ("tiny", 7)]
    assert [r.case for r in result.scenarios] == ["tiny@6", "tiny@7"]
    # Two realities, two oracles: the slower one holds less.
    assert result.scenarios[1].oracle_objective < result.scenarios[0].oracle_objective
    assert result.truth_seeds == (6, 7) and result.held_out
    text = markdown(result)
    assert "truth seeds 6-7, held out" in text and "| tiny@7 |" in text
    data = json.loads(to_json(result))
    assert data["truth_seeds"] == [6, 7] and data["held_out"] is True
    assert data["development_truth_seeds"] == list(DEVELOPMENT_TRUTH_SEEDS)
    loaded = load_result(data)
    assert loaded.truth_seeds == (6, 7) and loaded.scenarios == result.scenarios


def test_a_result_on_a_development_seed_says_it_is_not_held_out() -> None:
    from batchtune.bench.report import markdown

    result = bench((0,))
    assert not result.held_out
    assert "NOT held out" in markdown(result)


def test_the_cli_reports_on_the_held_out_seeds_by_default(monkeypatch) -> None:
    import batchtune.bench.runner as runner
    from batchtune.cli import main

    seen: list[tuple[int, ...]] = []

    def fake_run_bench(scenarios, factory, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(tuple(kwargs["truth_seeds"]))
        return runner.BenchResult(seed=kwargs["seed"], noise=0.0, scenarios=(), summary=(), seconds=0.0,
                                  truth_seeds=tuple(kwargs["truth_seeds"]))

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    assert main(["bench", "tuning", "--quick", "--scenarios", "chat-8b-h100-tight", "-o", "json"]) == 0
    assert main(["bench", "tuning", "--quick", "--scenarios", "chat-8b-h100-tight", "-o", "json",
                 "--truth-seeds", "0"]) == 0
    assert main(["bench", "tuning", "--quick", "--scenarios", "chat-8b-h100-tight", "-o", "json",
                 "--truth", "nominal"]) == 0
    assert seen == [REPORTING_TRUTH_SEEDS, (0,), ()]
    assert main(["bench", "tuning", "--truth-seeds", "5-1"]) == 2
