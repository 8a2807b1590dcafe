"""A lengthened load run sees the requests of its whole window (issue 21: costs and evidence billed alike).

The operator lengthens a run with too few requests behind its percentiles (up to 1200 s); the bench billed such
a run in full but simulated at most 300 s of it, so slow requests never reached the sample count and every
strategy gave up on settings that hold the SLO (kvbound-70b-a100x2-longctx: no choice at any truth seed).
"""

from __future__ import annotations

from batchtune.bench.reality import PerturbedTruth
from batchtune.bench.scenarios import get_scenarios
from batchtune.bench.types import Knobs, Load


def test_a_window_longer_than_the_prompt_run_cap_is_simulated_in_full() -> None:
    scenario = get_scenarios(["chat-8b-h100-tight"])[0]
    truth = PerturbedTruth(truth_seed=1)

    def completed(seconds: float) -> tuple[float, float]:
        reading = truth.measure(scenario, Knobs(16, 90), Load("concurrency", 2.0), duration_s=seconds, seed=1,
                                noise=0.0, warmup_s=5.0)
        return reading.get("duration", 0.0), reading.get("completed", 0.0)

    short, long = completed(300.0), completed(900.0)
    assert long[0] == 900.0
    assert long[1] > 2.5 * short[1] > 0
