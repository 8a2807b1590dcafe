"""Our strategies' harness: an operator-style trial carries what the operator's trial metrics carry."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from batchtune.bench.evaluate import TrialProtocol, operator_trial
from batchtune.bench.scenarios import Scenario
from batchtune.bench.strategies.ours import to_outcome
from batchtune.bench.types import Knobs, Load, Reading, Slo, StartResult
from batchtune.core.objective import Objective

CLOSED = Scenario(name="scripted-closed", summary="scripted", model="Llama-3.1-8B", gpu="H100", input_len=100,
                  output_len=10, slo=Slo({"p95_ttft_ms": 1000.0, "p95_itl_ms": 40.0}), load_kind="concurrency")


@dataclass
class ScriptedTestbed:
    """Concurrency up to `capacity` passes with the cache 60% full; above it the cache fills and preempts."""

    capacity: int
    loads: list[float] = field(default_factory=list)

    def start(self, knobs: Knobs) -> StartResult:
        return StartResult(True, 60.0)

    def run_load(self, load: Load, *, prompts=None, warmup=False, seconds=None) -> Reading:
        self.loads.append(load.value)
        over = load.value > self.capacity
        return Reading(load, {
            "p95_ttft_ms": 2000.0 if over else 200.0, "p95_itl_ms": 20.0, "request_throughput": load.value / 10,
            "output_throughput": load.value, "kv_cache_usage_pct": 99.0 if over else 60.0,
            "preemptions_per_s": 2.5 if over else 0.0, "max_concurrent_requests": min(load.value, 16),
            "completed": 100.0, "failed": 0.0,
        })


def test_capacity_trial_carries_the_peak_over_its_load_steps() -> None:
    testbed = ScriptedTestbed(capacity=12)
    result = operator_trial(testbed, CLOSED, Knobs(16, 90), protocol=TrialProtocol(headroom_pct=10))
    assert result.met and result.reading is not None
    assert result.reading.get("kv_cache_usage_pct") == 60.0  # the capacity step's own reading
    assert any(load > 12 for load in testbed.loads)
    outcome = to_outcome(result, Objective.SLO_CAPACITY)
    assert outcome.metric("kvCacheUsagePercent") == 60.0
    assert outcome.metric("kvCacheUsagePeakPercent") == 99.0
    assert outcome.metric("preemptionsPeakPerSecond") == 2.5


def test_trial_with_no_passing_load_reports_its_lowest_step() -> None:
    # As the controller's trial_outcome: the lowest load's metrics, so the strategy can read why it failed.
    testbed = ScriptedTestbed(capacity=0)
    result = operator_trial(testbed, CLOSED, Knobs(16, 90), protocol=TrialProtocol(headroom_pct=10))
    assert not result.met and result.reading is not None
    assert result.reading.load.value == min(testbed.loads)
    outcome = to_outcome(result, Objective.SLO_CAPACITY)
    assert outcome.metric("ttftMs") == 2000.0


@pytest.mark.parametrize(("load", "running", "waiting"), [
    pytest.param(Load("concurrency", 256), 64.0, 192.0, id="closed-loop-queue"),
    pytest.param(Load("concurrency", 32), 32.0, 0.0, id="closed-loop-all-running"),
    pytest.param(Load("request_rate", 5.0), 64.0, None, id="open-loop-unknown"),
])
def test_waiting_requests_on_a_closed_loop(load, running, waiting) -> None:
    from batchtune.bench.evaluate import status_metrics

    reading = Reading(load, {"p95_ttft_ms": 10.0, "max_concurrent_requests": running})
    assert status_metrics(reading, CLOSED, 95).get("waitingRequests") == waiting


def test_prefilter_prunes_enter_the_history_as_memory_failures() -> None:
    # As the operator (`core.search`): a column cut short by memory must read as KV-bound to Adaptive.
    from batchtune.core.planning import FitVerdict, SearchSpace, plan_candidates
    from batchtune.core.search import learned_from_pruned
    from batchtune.core.vocabulary import Reason
    from batchtune.engines import VLLM

    def fit(s):
        if s.gpu_memory_utilization_percent == 98:
            text = "Free memory on device cuda:0 (70 GiB) is less than desired"
            return FitVerdict(False, text, VLLM.classify_failure(text))
        if s.max_num_seqs >= 64:
            text = "No available memory for the cache blocks"
            return FitVerdict(False, text, VLLM.classify_failure(text))
        return FitVerdict(s.max_num_seqs < 32 or None, "")

    space = SearchSpace((16, 32, 64), (90, 98))
    plan = plan_candidates(space, fits=fit)
    learned = dict(learned_from_pruned(plan.pruned, set(plan_candidates(space).candidates)))
    assert {(s.max_num_seqs, s.gpu_memory_utilization_percent) for s in learned} == {(64, 90), (16, 98), (32, 98), (64, 98)}
    assert {o.reason for s, o in learned.items() if s.gpu_memory_utilization_percent == 98} == \
        {Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH}
    assert all(o.state.value == "Infeasible" for o in learned.values())
    assert next(o for s, o in learned.items() if s.max_num_seqs == 64 and s.gpu_memory_utilization_percent == 90).reason \
        == Reason.KV_CACHE_TOO_SMALL


@dataclass(frozen=True)
class BurstOnlyOomTruth:
    """The synthetic truth, except that gmu >= 94 runs out of memory on a step of the full token budget, which only
    a burst (prompts sent at once, a prompt-counted run) reaches: a trial's timed runs keep their prefills spread."""

    base: object = field(default_factory=lambda: __import__("batchtune.bench.synthetic", fromlist=["x"])
                         .SyntheticTruth(memory_gib=24.0, oom_gmu_pct=101))

    def startup(self, scenario, knobs):
        return self.base.startup(scenario, knobs)

    def measure(self, scenario, knobs, load, *, duration_s, seed, noise, prompts=None, warmup_s=None):
        budget = knobs.max_num_batched_tokens or 8192
        if knobs.gpu_memory_utilization_pct >= 94 and prompts is not None and prompts * scenario.input_len >= budget:
            return Reading(load, failure="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.base.measure(scenario, knobs, load, duration_s=duration_s, seed=seed, noise=noise,
                                 prompts=prompts, warmup_s=warmup_s)


def test_a_setting_whose_full_budget_burst_crashes_is_never_chosen() -> None:
    # Issue 21: the KV cache binds (long prompts on 24 GiB), so the best capacity is at the highest gmu; at gmu >= 94
    # every trial's load holds, but the first burst of long prompts kills the server. The prefilter cannot say.
    from batchtune.bench.scenarios import KnobGrid
    from batchtune.bench.strategies.ours import CoreStrategy
    from batchtune.bench.testbed import SimTestbed

    scenario = Scenario(name="burst-oom", summary="fits at light load, crashes under a full burst",
                        model="meta-llama/Llama-3.1-8B-Instruct", gpu="L4", input_len=2000, output_len=256,
                        max_model_len=8192, slo=Slo({"p95_ttft_ms": 20000.0, "p95_itl_ms": 200.0}),
                        load_kind="concurrency", tuner_space=KnobGrid((4, 8, 16, 32), (85, 90, 94, 98), (8192,)))
    testbed = SimTestbed(scenario, BurstOnlyOomTruth(), seed=0, noise=0.0)
    choice = CoreStrategy("Adaptive").tune(testbed, scenario, seed=0)
    assert choice.knobs is not None, choice.note
    assert choice.knobs.gpu_memory_utilization_pct < 94, choice
    assert testbed.ledger.runtime_failures >= 1  # a burst at gmu >= 94 was tried and failed
