"""Common random numbers: every strategy sees the same noise draws in the same world."""

from __future__ import annotations

from dataclasses import replace

from bench_fixtures import TINY

from batchtune.bench.runner import run_scenario
from batchtune.bench.strategies.doubling import Doubling
from batchtune.bench.synthetic import SyntheticTruth
from batchtune.bench.testbed import SimTestbed
from batchtune.bench.types import Knobs, Load

A, B = Knobs(32, 90), Knobs(128, 95)
LOW, HIGH = Load("request_rate", 2.0), Load("request_rate", 6.0)


def _ttft(testbed: SimTestbed, load: Load) -> float:
    return testbed.run_load(load).get("p95_ttft_ms")


def test_two_strategies_measuring_the_same_step_get_the_identical_reading_whatever_they_asked_before() -> None:
    first = SimTestbed(TINY, SyntheticTruth(), seed=5, noise=0.05)
    second = SimTestbed(TINY, SyntheticTruth(), seed=5, noise=0.05)
    # The first strategy looks at B first, then A low, A high, A low again.
    first.start(B)
    _ttft(first, LOW)
    first.start(A)
    a_low, a_high, a_low_again = _ttft(first, LOW), _ttft(first, HIGH), _ttft(first, LOW)
    # The second asks in another order, with a restart in between.
    second.start(A)
    b_high = _ttft(second, HIGH)
    second.start(A)
    assert _ttft(second, LOW) == a_low  # repeat 0 of (A, LOW)
    assert _ttft(second, LOW) == a_low_again  # repeat 1 of (A, LOW)
    assert b_high == a_high
    # Repeats are fresh draws, and another world is another draw.
    assert a_low_again != a_low
    other = SimTestbed(TINY, SyntheticTruth(), seed=6, noise=0.05)
    other.start(A)
    assert _ttft(other, LOW) != a_low


def test_the_truth_seed_is_part_of_the_world() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Seeded(SyntheticTruth):
        truth_seed: int = 0

    def reading(truth_seed: int) -> float:
        testbed = SimTestbed(TINY, Seeded(truth_seed=truth_seed), seed=5, noise=0.05)
        testbed.start(A)
        return _ttft(testbed, LOW)

    assert reading(1) == reading(1) != reading(2)


def test_the_same_strategy_under_two_names_makes_the_same_run() -> None:
    """The runner gives every strategy the same world: only its name differs, so nothing else may."""
    noisy = replace(TINY, name="tiny-noisy")
    result = run_scenario(noisy, SyntheticTruth(), seed=9, noise=0.08,
                          strategies=[Doubling(), Doubling(name="doubling_again")], with_tpe=False)
    one, two = result.runs
    assert (one.strategy, two.strategy) == ("doubling", "doubling_again")
    assert replace(two, strategy="doubling") == one
