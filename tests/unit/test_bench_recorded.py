"""The recorded real engine as a truth (`bench.recorded`): readings come only from the recorded repeats, drawn per
seed; the judge's capacity is the highest recorded concurrency the repeats' mean holds; what was not recorded is
refused; the cache key carries the recording's content; the perturbed truth is untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchtune.bench.cache import cache_key, fingerprint_sources
from batchtune.bench.evaluate import Judge
from batchtune.bench.oracle import run_oracle
from batchtune.bench.recorded import (
    DEFAULT_RECORDING,
    RECORDED_SLO_MS,
    RecordedTruth,
    load_recording,
    recorded_scenarios,
    recorded_strategies,
)
from batchtune.bench.runner import _within_band, default_strategies
from batchtune.bench.scenarios import get_scenarios
from batchtune.bench.testbed import SimTestbed
from batchtune.bench.types import Knobs, Load

RUNS = DEFAULT_RECORDING / "runs"
DERIVED = {"max_concurrent_requests", "mean_running_requests", "kv_cache_tokens"}
"""The figures the truth adds or renames (the closed loop's running batch; the file's scraped `kv_cache_size_tokens`);
every other is the file's own."""
SCENARIO = recorded_scenarios()[0]
TRUTH = RecordedTruth()


def _file(mns: int, conc: int, rep: int) -> dict:
    return json.loads((RUNS / f"mns{mns}-c{conc}-r{rep}.json").read_text())


def test_the_scenario_is_the_recordings() -> None:
    rec = load_recording(str(DEFAULT_RECORDING))
    assert (SCENARIO.model, SCENARIO.gpu, SCENARIO.max_model_len) == ("tiny-llama-v1", "CPU-node", 2048)
    assert (SCENARIO.input_len, SCENARIO.output_len, SCENARIO.load_kind) == (64, 32, "concurrency")
    assert "--concurrency 1,2,4,8,16,32" in rec.command and "--repeats 2" in rec.command
    assert SCENARIO.tuner_space.grid() == [Knobs(m, 10) for m in (2, 4, 8, 16)] == SCENARIO.oracle_space.grid()
    assert SCENARIO.default_gmu_pct == 10
    # The SLO puts every setting's capacity inside the recorded loads: met at c=1, missed at a recorded concurrency.
    assert SCENARIO.slo.limits == {"p95_ttft_ms": RECORDED_SLO_MS}
    for mns in (2, 4, 8, 16):
        means = {c: (_file(mns, c, 1)["p95_ttft_ms"] + _file(mns, c, 2)["p95_ttft_ms"]) / 2 for c in rec.concurrencies(mns)}
        assert means[1] <= RECORDED_SLO_MS < means[32]
    # Not one of the simulated suite's scenarios: the perturbed and nominal runs are as before.
    assert SCENARIO.name not in {s.name for s in get_scenarios()}


@pytest.mark.parametrize("mns", [2, 4, 8, 16])
def test_every_reading_is_one_recorded_repeat(mns: int) -> None:
    for conc in (1, 2, 4, 8, 16, 32):
        files = [_file(mns, conc, r) for r in (1, 2)]
        drawn = set()
        for seed in range(12):
            reading = TRUTH.measure(SCENARIO, Knobs(mns, 10), Load("concurrency", float(conc)), duration_s=60.0,
                                    seed=seed, noise=0.03)
            assert reading.ok and reading.load == Load("concurrency", float(conc))
            own = {k: v for k, v in reading.metrics.items() if k not in DERIVED}
            matches = [i for i, f in enumerate(files) if all(f[k] == v for k, v in own.items())]
            assert len(matches) >= 1, (mns, conc, seed)
            assert {"p95_ttft_ms", "request_throughput", "completed", "mean_e2el_ms"} <= set(own)
            drawn.add(matches[0])
            assert reading.metrics["max_concurrent_requests"] == min(conc, mns)
            assert reading.metrics["kv_cache_tokens"] == float(files[matches[0]]["kv_cache_size_tokens"])
        assert drawn == {0, 1}  # both repeats are drawn over the seeds


def test_a_reading_is_fixed_by_its_seed_and_common_to_every_strategy() -> None:
    def reading(seed: int, first: float | None) -> dict:
        testbed = SimTestbed(SCENARIO, TRUTH, seed=seed, noise=0.03)
        assert testbed.start(Knobs(8, 10)).ok
        if first is not None:  # another strategy asked something else before
            testbed.run_load(Load("concurrency", first))
        return dict(testbed.run_load(Load("concurrency", 16.0)).metrics)

    assert reading(5, None) == reading(5, None) == reading(5, 4.0)
    assert len({json.dumps(reading(s, None), sort_keys=True) for s in range(10)}) == 2


def test_the_judge_reads_the_mean_and_its_capacity_is_hand_computed_from_the_files() -> None:
    # mns4 (tests/data/real-vllm-curve/runs/mns4-c*-r*.json), P95 TTFT of the two repeats: c=8 204.99 and 204.00 ms
    # (mean 204.5 <= 250), c=16 452.30 and 334.75 ms (mean 393.5 > 250), c=32 higher still: capacity c=8, and the
    # objective the request throughput there, (27.794 + 26.924) / 2 = 27.359 req/s; the repeats' spread 26.92-27.79.
    judge = Judge(SCENARIO, TRUTH)
    evaluation = judge.objective(Knobs(4, 10))
    assert evaluation.load == Load("concurrency", 8.0)
    assert evaluation.objective == pytest.approx((27.794340369712582 + 26.92378809131687) / 2)
    assert evaluation.objective == pytest.approx(27.359, abs=1e-3)
    assert TRUTH.noise_band(Knobs(4, 10), evaluation.load) == pytest.approx((26.92378809131687, 27.794340369712582))
    assert evaluation.reading is not None
    assert evaluation.reading.get("p95_ttft_ms") == pytest.approx((204.99265004973495 + 203.99610654940258) / 2)
    # The oracle's capacities are recorded concurrencies only, and its best is the best of the four.
    oracle = run_oracle(judge)
    loads = {k.max_num_seqs: judge.objective(k).load for k in SCENARIO.tuner_space.grid()}
    assert all(load is not None and load.value in (1, 2, 4, 8, 16, 32) for load in loads.values())
    assert oracle.best.objective == max(judge.objective(k).objective for k in SCENARIO.tuner_space.grid())


def test_a_load_between_recorded_ones_is_served_at_the_next_lower_and_counted() -> None:
    testbed = SimTestbed(SCENARIO, TRUTH, seed=1, noise=0.03)
    assert testbed.start(Knobs(4, 10)).ok
    reading = testbed.run_load(Load("concurrency", 12.0))
    assert reading.ok and reading.load == Load("concurrency", 8.0)
    assert reading.get("completed") == 64  # an 8-stream recorded run (8 prompts per stream)
    testbed.run_load(Load("concurrency", 16.0))
    assert (testbed.ledger.load_steps, testbed.ledger.lower_load_steps) == (2, 1)
    above = TRUTH.measure(SCENARIO, Knobs(4, 10), Load("concurrency", 64.0), duration_s=60, seed=0, noise=0.03)
    assert above.load == Load("concurrency", 32.0)  # never credited with more than the recording holds
    below = TRUTH.measure(SCENARIO, Knobs(4, 10), Load("concurrency", 0.5), duration_s=60, seed=0, noise=0.03)
    assert not below.ok and "not in the recording" in (below.failure or "")
    rate = TRUTH.measure(SCENARIO, Knobs(4, 10), Load("request_rate", 5.0), duration_s=60, seed=0, noise=0.03)
    assert not rate.ok and "closed loops" in (rate.failure or "")


def test_a_claimed_load_is_confirmed_only_by_a_recorded_load_at_or_above_it() -> None:
    judge = Judge(SCENARIO, TRUTH)
    # mns16: the repeats' mean P95 TTFT is 110 ms at c=16 and 307 ms at c=32 (limit 250 ms).
    assert judge.holds(Knobs(16, 10), Load("concurrency", 16.0))
    assert judge.holds(Knobs(16, 10), Load("concurrency", 12.0))  # c=16 holds, so c=12 does
    assert not judge.holds(Knobs(16, 10), Load("concurrency", 31.0))  # only c=32 could confirm it, and it fails
    assert not judge.holds(Knobs(16, 10), Load("concurrency", 32.0))
    assert not judge.holds(Knobs(2, 10), Load("concurrency", 64.0))  # above the recording: never confirmed
    assert TRUTH.confirming_load(Knobs(16, 10), Load("concurrency", 5.0)) == Load("concurrency", 8.0)


@pytest.mark.parametrize("knobs", [Knobs(3, 10), Knobs(4, 90), Knobs(4, 10, 2048), Knobs(32, 10)])
def test_an_unrecorded_setting_fails_to_start_and_says_why(knobs: Knobs) -> None:
    start = TRUTH.startup(SCENARIO, knobs)
    assert not start.ok and start.seconds == 0.0
    assert f"{knobs.label()} is not in the recording" in (start.error or "")
    testbed = SimTestbed(SCENARIO, TRUTH, seed=0, noise=0.03)
    assert not testbed.start(knobs).ok and testbed.ledger.failed_starts == 1 and testbed.running is None
    assert not TRUTH.measure(SCENARIO, knobs, Load("concurrency", 4.0), duration_s=60, seed=0, noise=0.03).ok
    assert Judge(SCENARIO, TRUTH).objective(knobs).objective == 0.0


def test_a_recorded_start_costs_the_pod_overhead_and_the_recorded_start() -> None:
    assert TRUTH.startup(SCENARIO, Knobs(8, 10)).seconds == pytest.approx(20.0 + 18.6)


def test_the_cache_key_carries_the_recordings_content(tmp_path: Path) -> None:
    assert "recorded.py" in {p.name for p in fingerprint_sources()}
    copy = tmp_path / "rec"
    shutil.copytree(DEFAULT_RECORDING, copy)
    same = cache_key(Judge(SCENARIO, RecordedTruth(str(copy))))
    assert RecordedTruth(str(copy)).data_fingerprint == TRUTH.data_fingerprint
    run = copy / "runs" / "mns4-c8-r1.json"
    data = json.loads(run.read_text())
    data["p95_ttft_ms"] += 1.0
    run.write_text(json.dumps(data))
    load_recording.cache_clear()
    edited = RecordedTruth(str(copy))
    assert edited.data_fingerprint != TRUTH.data_fingerprint
    assert cache_key(Judge(SCENARIO, edited)) != same


def test_the_strategies_are_the_defaults_less_auto_tune() -> None:
    names = [s.name for s in recorded_strategies(TRUTH)]
    assert names == [s.name for s in default_strategies(TRUTH) if s.name != "auto_tune"]


def test_a_choice_is_within_the_band_when_its_repeats_reach_the_best() -> None:
    bands = [{"setting": "a", "objective": 75.0, "low": 63.3, "high": 86.9},
             {"setting": "b", "objective": 54.3, "low": 54.1, "high": 54.5},
             {"setting": "c", "objective": 60.0, "low": 55.0, "high": 63.3},
             {"setting": "d", "objective": 0.0, "low": 0.0, "high": 0.0}]
    assert _within_band(bands, "a", "a") is True
    assert _within_band(bands, "b", "a") is False
    assert _within_band(bands, "c", "a") is True
    assert _within_band(bands, "d", "a") is False
    assert _within_band(bands, None, "a") is None


def test_the_cli_lists_the_recorded_scenario_and_refuses_a_recording_without_the_truth(capsys) -> None:
    from batchtune.cli import main

    assert main(["bench", "tuning", "--truth", "recorded", "--list"]) == 0
    assert "recorded-tiny-cpu-ttft" in capsys.readouterr().out
    assert main(["bench", "tuning", "--recording", str(DEFAULT_RECORDING), "--list"]) == 2
    assert "--recording needs --truth recorded" in capsys.readouterr().err
    assert main(["bench", "tuning", "--list"]) == 0
    assert "recorded-tiny-cpu-ttft" not in capsys.readouterr().out


def test_the_perturbed_truth_reads_and_judges_as_before() -> None:
    # Figures of main at cca5119 (before the recorded truth), the same calls: a perturbed reality's judge and one noisy
    # step billed on its testbed. (The whole of run_scenario on this case, adaptive + doubling + hill_climb, was
    # compared figure for figure against main once by hand: identical; too slow for a unit test.)
    from bench_fixtures import TINY

    from batchtune.bench.reality import PerturbedTruth

    truth = PerturbedTruth(truth_seed=1)
    evaluation = Judge(TINY, truth).objective(Knobs(32, 90))
    assert evaluation.objective == pytest.approx(19.992, rel=1e-12)
    assert evaluation.load is not None and evaluation.load.kind == "request_rate"
    assert evaluation.load.value == pytest.approx(19.992, rel=1e-12)
    testbed = SimTestbed(TINY, truth, seed=3, noise=0.03)
    assert testbed.start(Knobs(32, 90)).ok
    reading = testbed.run_load(Load("request_rate", 10.0))
    assert reading.get("p95_ttft_ms") == pytest.approx(64.91293235910902, rel=1e-12)
    assert reading.get("request_throughput") == pytest.approx(11.739449029815292, rel=1e-12)
    assert testbed.ledger.gpu_seconds == pytest.approx(152.5985202741623, rel=1e-12)
    assert testbed.ledger.lower_load_steps == 0
