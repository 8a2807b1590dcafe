"""The oracle and the noise-free load searches, on synthetic ground truths with known answers."""

from __future__ import annotations

import math

import pytest

from batchtune.bench.evaluate import Judge
from batchtune.bench.loadsearch import exact_capacity
from batchtune.bench.oracle import regret, run_oracle
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.types import Knobs, Load, Reading, Slo, StartResult

SLO = Slo({"p95_ttft_ms": 100.0})


def step_measure(capacity: float):
    """Latency is 50 ms up to `capacity`, then 1 s: a sharp knee at a known load."""
    calls: list[float] = []

    def measure(load: Load) -> Reading:
        calls.append(load.value)
        ttft = 50.0 if load.value <= capacity else 1000.0
        # Saturated (a deep closed loop) the server serves more than it can within the SLO.
        served = capacity * 1.2 if load.kind == "concurrency" else min(load.value, capacity * 1.2)
        return Reading(load, {"p95_ttft_ms": ttft, "request_throughput": served})

    return measure, calls


@pytest.mark.parametrize("capacity", [pytest.param(c, id=f"cap-{c}") for c in (0.3, 7.3, 42.0, 900.0)])
@pytest.mark.parametrize("hint", [pytest.param(None, id="cold"), pytest.param(5.0, id="hinted")])
def test_exact_capacity_finds_a_rate_knee_within_tolerance(capacity: float, hint: float | None) -> None:
    measure, _ = step_measure(capacity)
    found = exact_capacity(measure, SLO, "request_rate", saturation_concurrency=64, hint=hint)
    assert found.load is not None
    assert capacity * (1 - 0.006) <= found.value <= capacity


@pytest.mark.parametrize("capacity", [pytest.param(c, id=f"cap-{c}") for c in (1, 7, 64, 100, 333)])
def test_exact_capacity_finds_a_concurrency_knee_exactly(capacity: int) -> None:
    measure, _ = step_measure(capacity)
    found = exact_capacity(measure, SLO, "concurrency", saturation_concurrency=64)
    assert found.value == capacity


def test_exact_capacity_is_none_when_even_the_least_load_fails() -> None:
    def measure(load: Load) -> Reading:
        return Reading(load, {"p95_ttft_ms": 500.0, "request_throughput": 1.0})

    assert exact_capacity(measure, SLO, "request_rate", saturation_concurrency=8).load is None


class GridTruth:
    """Capacity is a known function of the knobs; gmu 98 dies at runtime, gmu 80 does not start."""

    def capacity(self, knobs: Knobs) -> float:
        # Rises with the batch up to 64, and with gmu (more KV) for large batches.
        return min(knobs.max_num_seqs, 64) * (1 + (knobs.gpu_memory_utilization_pct - 84) / 100) / 4

    def startup(self, scenario: object, knobs: Knobs) -> StartResult:
        if knobs.gpu_memory_utilization_pct < 84:
            return StartResult(False, 10.0, "No available memory for the cache blocks.")
        return StartResult(True, 60.0)

    def measure(self, scenario, knobs, load, *, duration_s, seed, noise, prompts=None, warmup_s=None) -> Reading:
        if knobs.gpu_memory_utilization_pct >= 98:
            return Reading(load, failure="torch.OutOfMemoryError: CUDA out of memory.")
        cap = self.capacity(knobs)
        rate = load.value if load.kind == "request_rate" else load.value / 2
        ttft = 50.0 if rate <= cap else 5000.0
        return Reading(load, {"p95_ttft_ms": ttft, "request_throughput": min(rate, cap), "preemptions_per_s": 0.0})


TINY = Scenario(
    name="tiny", summary="synthetic", model="Llama-3.1-8B", gpu="H100", input_len=100, output_len=10, slo=SLO,
    oracle_space=KnobGrid((8, 16, 32, 64, 128), (80, 86, 90, 96, 98)),
    tuner_space=KnobGrid((8, 64), (90,)),
)


def test_oracle_picks_the_brute_force_best_and_sees_the_runtime_oom_at_max_gmu() -> None:
    truth = GridTruth()
    oracle = run_oracle(Judge(TINY, truth))
    feasible = [k for k in TINY.oracle_space.grid() if 84 <= k.gpu_memory_utilization_pct < 98]
    expected = max(truth.capacity(k) for k in feasible)
    assert oracle.objective == pytest.approx(expected, rel=0.01)
    # Ties at equal capacity go to the smaller batch.
    assert oracle.best.knobs == Knobs(64, 96)
    assert oracle.feasible == len(feasible)
    assert oracle.best_at_max_gmu == 0.0
    assert oracle.best_gmu_below_max


def test_oracle_includes_off_grid_extras() -> None:
    oracle = run_oracle(Judge(TINY, GridTruth()), extra=[Knobs(64, 97)])
    assert oracle.best.knobs == Knobs(64, 97)
    assert oracle.grid_size == TINY.oracle_space.size + 1


@pytest.mark.parametrize(
    ("best", "chosen", "expected"),
    [
        pytest.param(10.0, 10.0, 0.0, id="optimal"),
        pytest.param(10.0, 9.0, 0.1, id="ten-percent"),
        pytest.param(10.0, 0.0, 1.0, id="nothing"),
        pytest.param(10.0, 11.0, 0.0, id="never-negative"),
        pytest.param(0.0, 0.0, 0.0, id="infeasible-scenario"),
    ],
)
def test_regret(best: float, chosen: float, expected: float) -> None:
    assert math.isclose(regret(best, chosen), expected, abs_tol=1e-12)


def test_an_off_grid_settings_value_does_not_depend_on_what_else_was_chosen() -> None:
    # The load search ends anywhere within its tolerance of the knee, so where it starts shows in the value; an
    # off-grid choice must start where its own grid neighbour says, or the cache keeps another run's figure.
    alone, after = Knobs(40, 97), Knobs(24, 97)
    values = [{e.knobs: e.objective for e in _evaluations(extra)} for extra in ([alone], [after, alone])]
    assert values[0][alone] == values[1][alone]


def _evaluations(extra: list[Knobs]) -> list:
    judge = Judge(TINY, GridTruth())
    run_oracle(judge, extra=extra)
    return list(judge._cache.values())
