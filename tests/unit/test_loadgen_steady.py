"""The steady-state end of the warm-up, in real runs of the load generator against the twin server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batchtune.core.warmup import STEADY_MIN_S
from batchtune.loadgen import LoadRun, compact_summary, run_load
from batchtune.twin.config import ServeConfig
from batchtune.twin.engine import SimEngine
from batchtune.twin.server import ServerOptions, TwinServer

MODEL, GPU, SCALE = "meta-llama/Llama-3.1-8B-Instruct", "A100-40GB", 5.0
WARMUP_S, MEASURE_S = 20.0, 8.0


def _runs(*loads: dict[str, Any]) -> list[dict[str, Any]]:
    """Each load in turn on one twin server (8 sequences at most: about 10 req/s of 256/64 tokens)."""

    async def go() -> list[dict[str, Any]]:
        cfg = ServeConfig(model=MODEL, gpu=GPU, max_num_seqs=8, max_model_len=4096)
        server = TwinServer(SimEngine(cfg), ServerOptions(served_model_name=MODEL, port=0, time_scale=SCALE,
                                                       stats_log_interval_s=0), on_log=lambda *_a: None)  # fmt: skip
        await server.start()
        server.mark_ready()
        try:
            results = []
            for seed, load in enumerate(loads):  # other prompts each run: no prefix-cache hits from the last
                spec = LoadRun(base_url=f"http://127.0.0.1:{server.bound_port}", input_len=256, output_len=64,
                                num_prompts=10**6, warmup_s=WARMUP_S, duration_s=WARMUP_S + MEASURE_S,
                                time_scale=SCALE, seed=seed, **load)
                results.append(await run_load(spec))
            return results
        finally:
            await server.stop()

    return asyncio.run(asyncio.wait_for(go(), timeout=120))


@pytest.mark.wallclock
def test_a_load_that_settles_ends_its_warmup_early_and_keeps_its_window():
    fixed, steady = _runs({"concurrency": 4}, {"concurrency": 4, "steady_warmup": True})
    assert (fixed["warmup_steady"], fixed["warmup_ended"], fixed["warmup_elapsed_s"]) == (False, "time", WARMUP_S)
    assert steady["warmup_steady"] is True and steady["warmup_ended"] == "steady"
    assert STEADY_MIN_S <= steady["warmup_elapsed_s"] < WARMUP_S
    for result in (fixed, steady):  # the hard stop moved with the warm-up: the window keeps its length
        assert result["stopped_by_duration"] is True
        assert result["duration"] == pytest.approx(MEASURE_S, rel=0.05)
        assert result["completed"] > 0 and result["failed"] == 0
    summary = compact_summary(steady)
    assert '"warmup_ended":"steady"' in summary and '"warmup_elapsed_s":' in summary


@pytest.mark.wallclock
def test_a_load_above_capacity_keeps_growing_and_runs_the_whole_warmup():
    (result,) = _runs({"request_rate": 25.0, "steady_warmup": True})  # about 2.5 times what 8 sequences serve
    assert (result["warmup_ended"], result["warmup_elapsed_s"]) == ("time", WARMUP_S)
    assert result["duration"] == pytest.approx(MEASURE_S, rel=0.05)
    assert result["in_flight"] > result["completed"]  # the queue kept growing
