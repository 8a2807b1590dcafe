"""The steady-state end of a warm-up: the test itself, which runs use it, and what the operator asks for."""

from __future__ import annotations

from typing import Any

import pytest
from fake_world import spec, world

from batchtune.api import InvalidBatchTuning, parse_spec
from batchtune.core.manifests import LoadProfile, build_load_job, load_job_name
from batchtune.core.warmup import STEADY_MIN_S, STEADY_SPAN_CHECKS, LoadSample, WarmupMode, settled, steady_warmup


def _samples(rates: list[float], in_flight: list[int], issued_per_s: float = 10.0, first_done: int = 0) -> list[LoadSample]:
    """One sample per second: `rates[i]` output tokens in the interval ending at sample i, `in_flight` at each."""
    out, tokens = [], 0.0
    for i, (rate, flying) in enumerate(zip(rates, in_flight, strict=True)):
        tokens += rate if i else 0.0
        issued = int(issued_per_s * i) + flying
        out.append(LoadSample(at_s=float(i), issued=issued, finished=max(first_done if i else 0, issued - flying),
                              in_flight=flying, output_tokens=int(tokens)))
    return out


N = 2 * STEADY_SPAN_CHECKS + 1


@pytest.mark.parametrize("rates, in_flight, streams, expected", [
    pytest.param([1000.0] * N, [8] * N, 8, True, id="flat-closed-loop"),
    pytest.param([1000.0] * (N - 1), [8] * (N - 1), 8, False, id="too-early"),
    pytest.param([1000.0] * 5 + [1150.0] * 4, [8] * N, 8, False, id="rate-still-rising-15pct"),
    pytest.param([1000.0] * 5 + [1080.0] * 4, [8] * N, 8, True, id="rate-within-10pct"),
    pytest.param([0.0] * N, [8] * N, 8, False, id="no-tokens"),
    pytest.param([1000.0] * N, [10 + 5 * i for i in range(N)], None, False, id="queue-growing"),
    pytest.param([1000.0] * N, [20, 22, 19, 21, 20, 23, 18, 21, 22], None, True, id="queue-fluctuating"),
])  # fmt: skip
def test_settled(rates: list[float], in_flight: list[int], streams: int | None, expected: bool) -> None:
    assert settled(_samples(rates, in_flight), streams) is expected


def test_nothing_completed_or_streams_not_all_started_is_never_settled() -> None:
    samples = [LoadSample(at_s=float(i), issued=8, finished=0, in_flight=8, output_tokens=1000 * i) for i in range(N)]
    assert not settled(samples, 8)
    done = [LoadSample(s.at_s, s.issued, 1, s.in_flight, s.output_tokens) for s in samples]
    assert settled(done, 8)
    assert not settled(done, 16)  # a closed loop of 16 streams has issued 8 so far


def test_a_queue_growing_by_a_share_of_arrivals_never_settles_however_long_it_ran() -> None:
    # Above capacity the queue grows by (arrivals - completions): a fixed share of the arrivals at any time.
    for start in (0, 100, 1000):
        samples = [LoadSample(at_s=float(start + i), issued=20 * (start + i), finished=15 * (start + i),
                              in_flight=5 * (start + i), output_tokens=1500 * (start + i)) for i in range(N)]
        assert not settled(samples)
    assert STEADY_MIN_S == 2 * STEADY_SPAN_CHECKS


@pytest.mark.parametrize("mode, builtin, runs_before, trace, expected", [
    pytest.param(WarmupMode.STEADY, True, 1, False, True, id="later-run"),
    pytest.param(WarmupMode.STEADY, True, 0, False, False, id="first-run-on-the-pod"),
    pytest.param(WarmupMode.FIXED, True, 3, False, False, id="fixed"),
    pytest.param(WarmupMode.STEADY, False, 3, False, False, id="vllm-bench"),
    pytest.param(WarmupMode.STEADY, True, 3, True, False, id="trace"),
])  # fmt: skip
def test_which_runs_use_the_steady_test(mode: WarmupMode, builtin: bool, runs_before: int, trace: bool,
                                        expected: bool) -> None:
    assert steady_warmup(mode, builtin, runs_before, trace) is expected


def test_the_builtin_job_asks_for_the_steady_test_only_when_told() -> None:
    def args(profile: LoadProfile) -> list[str]:
        job = build_load_job("bt", "uid", "ns", 0, load_job_name("bt", 0, 1, 0, 0), image="img",
                             base_url="http://127.0.0.1:8000", model="m", profile=profile)
        return list(job["spec"]["template"]["spec"]["containers"][0]["args"])

    steady = args(LoadProfile(concurrency=8, warmup_seconds=30, steady_warmup=True))
    fixed = args(LoadProfile(concurrency=8, warmup_seconds=30))
    assert "--steady-warmup" in steady and "--steady-warmup" not in fixed
    assert steady[steady.index("--duration") + 1] == "90"  # the hard stop covers the fixed warm-up either way


def test_spec_trial_warmup_defaults_to_steady_and_rejects_other_values() -> None:
    assert parse_spec(spec()).trial.warmup is WarmupMode.STEADY
    assert parse_spec(spec(trial={"warmup": "Fixed"})).trial.warmup is WarmupMode.FIXED
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_spec(spec(trial={"warmup": "Quick"}))
    assert caught.value.paths == ["spec.trial.warmup"] and "Quick" in str(caught.value)


def _job_args_in_order(**overrides: Any) -> list[list[str]]:
    w = world(searchSpace={"maxNumSeqs": {"values": [32]}}, strategy={"type": "Adaptive", "maxTrials": 1},
              **overrides)
    seen: dict[str, list[str]] = {}
    for _ in range(400):
        w.tick()
        for name, job in w.jobs.items():
            seen.setdefault(name, list(job["spec"]["template"]["spec"]["containers"][0]["args"]))
        if w.phase in ("Succeeded", "Recommended", "Failed", "RolledBack"):
            break
    return [seen[c.split("/", 1)[1]] for c in w.created if c.startswith("Job/") and c.split("/", 1)[1] in seen]


def test_only_the_first_load_run_of_a_trial_warms_up_for_the_fixed_time() -> None:
    runs = _job_args_in_order()
    assert len(runs) >= 2, "the test needs a trial with several load steps"
    assert "--steady-warmup" not in runs[0]
    assert all("--steady-warmup" in args for args in runs[1:])
    fixed = _job_args_in_order(trial={"warmup": "Fixed"})
    assert len(fixed) == len(runs) and not any("--steady-warmup" in args for args in fixed)
