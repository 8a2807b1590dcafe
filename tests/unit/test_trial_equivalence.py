"""The bench measures a trial as the operator does: one scenario through both, the same load runs and verdicts.

The operator side is the real reconcile loop on the in-memory world (tests/unit/fake_world.py): load Jobs, their
load generator's summary, Prometheus. The bench side is the bench's own operator trial (`bench.evaluate.
operator_trial`) on its simulated GPU (`SimTestbed`) over a ground truth that answers from the same model. Both
drive `core.trial_loop`; this test is what keeps a copy of the loop from creeping back into either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
from fake_world import fresh_backoff, knee_model, world  # noqa: F401  (fixture)

from batchtune.bench.evaluate import TrialProtocol, TrialResult, operator_trial
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.testbed import SimTestbed
from batchtune.bench.types import Knobs, Load, Reading, Slo, StartResult
from batchtune.core.vocabulary import M

SEQS = (8, 16, 32, 64)


def open_loop_model(seqs: int, gmu: int, requests_per_minute: int) -> dict[str, float]:
    """An M/M/1-like server: capacity grows with the batch, TTFT explodes as the arrival rate nears it."""
    rate = requests_per_minute / 60
    capacity = 2.0 * seqs ** 0.8
    load = rate / capacity
    ttft = 100.0 / (1 - load) if load < 0.99 else 1e5
    itl = 10.0 + 30.0 * min(load, 1.0)
    served = min(rate, capacity)
    return {M.ITL_MS: itl, M.TTFT_MS: ttft, M.E2E_MS: ttft + 128 * itl, M.OUTPUT_THROUGHPUT: served * 128,
            M.REQUEST_THROUGHPUT: served, M.KV_CACHE_USAGE_PERCENT: min(100.0, 100 * load), M.GPU_UTIL_PERCENT: 90.0,
            M.POWER_WATTS: 400.0}


@dataclass(frozen=True)
class ModelTruth:
    """The bench's ground truth over a fake-world model: `vllm bench serve` keys, the requests a window finishes."""

    model: Any
    requests_per_second: float | None

    def startup(self, scenario: Scenario, knobs: Knobs) -> StartResult:
        return StartResult(True, 60.0)

    def measure(self, scenario: Scenario, knobs: Knobs, load: Load, *, duration_s: float, seed: int, noise: float,
                prompts: int | None = None, warmup_s: float | None = None) -> Reading:
        value = int(load.value) if load.kind == "concurrency" else int(round(load.value * 60))
        figures = self.model(knobs.max_num_seqs, knobs.gpu_memory_utilization_pct, value)
        done = 200 if self.requests_per_second is None else int(self.requests_per_second * duration_s)
        return Reading(load, {
            "p95_ttft_ms": figures[M.TTFT_MS], "p95_itl_ms": figures[M.ITL_MS], "p95_e2el_ms": figures[M.E2E_MS],
            "request_throughput": figures[M.REQUEST_THROUGHPUT], "output_throughput": figures[M.OUTPUT_THROUGHPUT],
            "kv_cache_usage_pct": figures[M.KV_CACHE_USAGE_PERCENT], "completed": float(done), "failed": 0.0,
            "max_concurrent_requests": float(min(knobs.max_num_seqs, value)) if load.kind == "concurrency"
            else math.nan,
        })


def capacity_world(**overrides: Any) -> Any:
    """A fake world tuning for SLO capacity with no fixed load (the closed loop's search starts at half the batch)."""
    w = world(**overrides)
    w.bt_spec["load"].pop("concurrency")
    return w


def operator_runs(w: Any) -> dict[int, list[tuple[int, int]]]:
    """Each trial's load runs as the operator started them: (load, measured seconds), in order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for trial, load, seconds in w.run_loads:
        out.setdefault(trial, []).append((load, seconds))
    return out


def bench_trials(w: Any, scenario: Scenario, truth: ModelTruth) -> list[TrialResult]:
    """The operator's trials, one by one in its order, through the bench's operator trial."""
    testbed = SimTestbed(scenario, truth, seed=0, noise=0.0)
    results: list[TrialResult] = []
    for trial in w.status["trials"]:
        setting = trial["setting"]
        knobs = Knobs(setting["maxNumSeqs"], setting["gpuMemoryUtilizationPercent"])
        results.append(operator_trial(testbed, scenario, knobs, protocol=TrialProtocol(headroom_pct=10),
                                      neighbours=results))
    return results


def assert_same(w: Any, scenario: Scenario, truth: ModelTruth) -> list[TrialResult]:
    w.run_until({"Applying", "Succeeded", "Recommended", "Failed"}, limit=2000)
    ran = operator_runs(w)
    results = bench_trials(w, scenario, truth)
    assert len(results) == len(w.status["trials"]) == len(SEQS)
    for trial, result in zip(w.status["trials"], results, strict=True):
        assert [(r.load, r.seconds) for r in result.runs] == ran[trial["index"]], trial["name"]
        assert result.conclusion is not None
        assert result.conclusion.verdict.value == trial["verdict"], trial["name"]
        assert result.conclusion.metrics.get(M.SLO_CAPACITY_LOAD) == (trial.get("metrics") or {}).get(
            M.SLO_CAPACITY_LOAD), trial["name"]
    return results


BASE = {"model": "Llama-3.1-8B", "gpu": "H100", "input_len": 512, "output_len": 128,
        "slo": Slo({"p95_ttft_ms": 2000.0, "p95_itl_ms": 60.0}),
        "tuner_space": KnobGrid(SEQS, (90,))}


def test_closed_loop_with_short_bracketing_steps_runs_the_same_steps(fresh_backoff) -> None:  # noqa: F811
    # 200 s windows: bracketing steps of 50 s (a quarter, and 3 scrape intervals), the capacity step re-measured in
    # full; production's peak unknown, so the curve step is a closed loop at the largest maxNumSeqs planned.
    w = capacity_world(trial={"measureSeconds": 200})
    w.production_peak_per_second = None
    scenario = Scenario(name="closed", summary="closed loop", load_kind="concurrency", measure_s=200.0, **BASE)
    results = assert_same(w, scenario, ModelTruth(knee_model, None))
    assert any(r.purpose is not None and r.purpose.value == "Bracket" for res in results for r in res.runs)
    assert any(r.purpose is not None and r.purpose.value == "Curve" for res in results for r in res.runs)
    assert {r.load for r in results[-1].runs if r.purpose is not None and r.purpose.value == "Curve"} <= {64}


def test_open_loop_runs_the_same_steps(fresh_backoff) -> None:  # noqa: F811
    # The search starts at spec.load.requestsPerMinute, production's peak (the same rate) is the curve load.
    w = capacity_world(load={"requestsPerMinute": 1200})
    w.model = open_loop_model
    w.production_peak_per_second = 20.0
    scenario = Scenario(name="open", summary="open loop", load_kind="request_rate", expected_rate=20.0,
                        measure_s=30.0, **BASE)
    results = assert_same(w, scenario, ModelTruth(open_loop_model, None))
    assert all(len(r.runs) >= 2 for r in results)


def test_too_few_requests_lengthens_the_same_runs(fresh_backoff) -> None:  # noqa: F811
    # 0.5 requests a second: a 30 s window finishes 15, fewer than a percentile needs, so a step runs again for
    # longer (50 s: 30 * 20 / 15 with a quarter to spare) on both sides; later search steps start at the grown window.
    w = capacity_world()
    w.requests_per_second = 0.5
    w.production_peak_per_second = None
    scenario = Scenario(name="few", summary="too few requests", load_kind="concurrency", measure_s=30.0, **BASE)
    results = assert_same(w, scenario, ModelTruth(knee_model, 0.5))
    search = [r.seconds for r in results[0].runs if r.purpose is None]
    assert search == [30, 50, 50]  # the step after a lengthened one starts at its grown window
    curve = [r.seconds for r in results[-1].runs if r.purpose is not None]
    assert curve == [30, 50]  # the curve step starts at the spec's window, and is lengthened as any run


@pytest.mark.parametrize("repeats", [2])
def test_repeats_run_the_same_steps(fresh_backoff, repeats) -> None:  # noqa: F811
    w = capacity_world(trial={"repeats": repeats})
    w.production_peak_per_second = None
    scenario = Scenario(name="repeats", summary="repeats", load_kind="concurrency", measure_s=30.0, **BASE)
    w.run_until({"Applying", "Succeeded", "Recommended", "Failed"}, limit=2000)
    ran = operator_runs(w)
    testbed = SimTestbed(scenario, ModelTruth(knee_model, None), seed=0, noise=0.0)
    results: list[TrialResult] = []
    for trial in w.status["trials"]:
        knobs = Knobs(trial["setting"]["maxNumSeqs"], trial["setting"]["gpuMemoryUtilizationPercent"])
        results.append(operator_trial(testbed, scenario, knobs,
                                      protocol=TrialProtocol(headroom_pct=10, repeats=repeats), neighbours=results))
        assert [(r.load, r.seconds) for r in results[-1].runs] == ran[trial["index"]]
