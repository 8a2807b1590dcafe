"""A small synthetic scenario the tuning-benchmark tests share (runs in a fraction of a second on SyntheticTruth)."""

from __future__ import annotations

from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.types import Slo

TINY = Scenario(
    name="tiny", summary="synthetic", model="Llama-3.1-8B", gpu="H100", input_len=512, output_len=128,
    slo=Slo({"p95_ttft_ms": 500.0, "p95_itl_ms": 30.0}),
    tuner_space=KnobGrid((8, 32, 128), (90, 95)),
    oracle_space=KnobGrid((8, 16, 32, 64, 128), (90, 95)),
    sim_window_s=10.0,
)
