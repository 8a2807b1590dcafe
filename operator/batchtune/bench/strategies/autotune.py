"""vLLM's `benchmarks/auto_tune/auto_tune.sh`, step for step (see reference/vllm-gpu-facts.md §4.3).

1. Memory probe: start the server with the largest max-num-seqs and max-num-batched-tokens at
   gpu-memory-utilization 0.98, stepping down by 0.01 (to 0.90) until it starts.
2. For every (max-num-seqs, max-num-batched-tokens) cell: start the server, run `vllm bench serve`
   with 1000 prompts at request rate inf; if the latency limit fails, rerun with 100 prompts at
   `int(throughput) + 1` req/s, stepping down by 1 until it holds (or the rate reaches 0).
3. Keep the cell with the highest request throughput among passing runs.

One change, the script's own step made finer: its step of 1 req/s cannot express a capacity below 1 req/s (it
stops at 1) and is coarse below about 10 (a 9.9 req/s capacity reads 9). As a user of the script would edit it for
slow models, the step-down's step here is the largest of 1, 0.5, 0.2, 0.1, 0.05, ... req/s that puts at least 10
steps below the rate=inf throughput (`rate_step`: step <= throughput / 10), and the step-down starts one step above
that throughput (`step * (floor(throughput / step) + 1)`, the script's `int(throughput) + 1` when the step is 1) and
goes down by one step while the rate is above 0. At 10 req/s and above it is the script exactly. The runs stay
prompt-counted and billed as the script runs them (`SimTestbed.run_load(prompts=...)`).

The script's only latency limit is P99 E2EL; here the scenario's whole SLO plays that role, which is
if anything kind to the baseline (it cannot pick a setting that fails a limit it never checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Choice, Knobs, Load, Testbed

MIN_RATE_STEPS = 10
"""The step-down's step puts at least this many steps below the rate=inf throughput."""
MIN_RATE_STEP = 0.001
"""req/s: the finest step (a throughput this low has no capacity worth tuning for)."""


@dataclass(frozen=True)
class AutoTune:
    name: str = "auto_tune"
    gmu_start_pct: int = 98
    gmu_stop_pct: int = 90
    inf_prompts: int = 1000
    stepdown_prompts: int = 100

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        space = scenario.tuner_space
        seqs_list = space.max_num_seqs
        mbt_list = space.max_num_batched_tokens
        gmu = self.probe_gpu_memory_utilization(testbed, max(seqs_list), _largest(mbt_list))
        if gmu is None:
            return Choice(None, None, "no gpu-memory-utilization in 0.98..0.90 started")
        best: tuple[float, Knobs, Load] | None = None
        for mns in seqs_list:
            for mbt in mbt_list:
                knobs = Knobs(mns, gmu, mbt)
                result = self.run_cell(testbed, scenario, knobs)
                if result is None:
                    continue
                throughput, load = result
                if best is None or throughput > best[0]:
                    best = (throughput, knobs, load)
        if best is None:
            return Choice(None, None, "no cell met the latency limit")
        return Choice(best[1], best[2], f"best throughput {best[0]:.2f} req/s")

    def probe_gpu_memory_utilization(self, testbed: Testbed, mns: int, mbt: int | None) -> int | None:
        for gmu in range(self.gmu_start_pct, self.gmu_stop_pct - 1, -1):
            if testbed.start(Knobs(mns, gmu, mbt)).ok:
                return gmu
        return None

    def run_cell(self, testbed: Testbed, scenario: Scenario, knobs: Knobs) -> tuple[float, Load] | None:
        """(request throughput, the request rate that met the limit) or None."""
        if not testbed.start(knobs).ok:
            return None
        reading = testbed.run_load(Load("request_rate", math.inf), prompts=self.inf_prompts)
        if not reading.ok:
            return None
        throughput = reading.get("request_throughput", 0.0)
        if math.isnan(throughput):
            return None
        if scenario.slo.met_by(reading.metrics):
            # rate=inf met the limit: the server holds whatever it can process.
            return throughput, Load("request_rate", max(throughput, 1e-3))
        for rate in stepdown_rates(throughput):
            reading = testbed.run_load(Load("request_rate", rate), prompts=self.stepdown_prompts)
            if not reading.ok:
                return None
            if scenario.slo.met_by(reading.metrics):
                return reading.get("request_throughput", rate), Load("request_rate", rate)
        return None


def rate_step(throughput: float) -> float:
    """The largest of 1, 0.5, 0.2, 0.1, 0.05, ... req/s with `MIN_RATE_STEPS` steps below `throughput` (1 when
    there is no throughput: the script's step), at least `MIN_RATE_STEP`."""
    if not throughput > 0:
        return 1.0
    exponent = 0
    while True:
        for mantissa in (1.0, 0.5, 0.2):
            step = round(mantissa * 10.0**-exponent, 12)
            if step * MIN_RATE_STEPS <= throughput or step <= MIN_RATE_STEP:
                return step
        exponent += 1


def stepdown_rates(throughput: float) -> list[float]:
    """The step-down's rates, highest first: one step above the rate=inf throughput, down by one step while > 0."""
    step = rate_step(throughput)
    top = math.floor(throughput / step + 1e-9) + 1 if throughput > 0 else 1
    return [round(k * step, 9) for k in range(top, 0, -1)]


def _largest(values: tuple[int | None, ...]) -> int | None:
    concrete = [v for v in values if v is not None]
    return max(concrete) if concrete else None
