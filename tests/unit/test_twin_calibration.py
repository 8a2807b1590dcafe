"""The twin reproduces public vLLM measurements (vllm-gpu-facts.md §5) within stated tolerances.

Run with `-s` to see the residual table; docs/twin.md shows the same table side by side.
"""

from __future__ import annotations

import pytest

from batchtune.twin.calibration import Residual, evaluate, format_residuals, reference_points
from batchtune.twin.config import ServeConfig
from batchtune.twin.predict import Workload, predict

_RESIDUALS: list[Residual] = evaluate()


def test_print_residuals() -> None:
    print("\n" + format_residuals(_RESIDUALS))
    assert len(_RESIDUALS) >= 30


@pytest.mark.parametrize("residual", [pytest.param(r, id=f"{r.point.label}:{r.key}") for r in _RESIDUALS
                                      if r.tolerance is not None])
def test_reference_within_tolerance(residual: Residual) -> None:
    assert residual.predicted is not None
    assert residual.within, (f"{residual.point.label} {residual.key}: model {residual.predicted:.2f} vs measured "
                             f"{residual.measured:.2f} ({residual.rel_error:+.1%}, tolerance {residual.tolerance:.0%})")


def test_a100_single_stream_near_77_percent_of_bandwidth_ceiling() -> None:
    # R3: 75 tok/s single stream is ~77% of the 97 tok/s weight-streaming ceiling of Llama-3.1-8B on A100-40GB.
    cfg = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="A100-40GB")
    one = predict(cfg, Workload(1024, 128, concurrency=1), 60)
    ceiling = cfg.gpu.bandwidth_gbps * 1e9 / (2 * cfg.model.params)
    assert 0.70 <= one["output_throughput"] / ceiling <= 0.85


def test_a100_knee_near_concurrency_8() -> None:
    # R3: 6.6x throughput at C=8 "with almost no latency cost"; past it, latency climbs.
    cfg = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="A100-40GB")
    runs = {c: predict(cfg, Workload(1024, 128, concurrency=c), 60) for c in (1, 8, 64)}
    gain = runs[8]["output_throughput"] / runs[1]["output_throughput"]
    assert 5.3 <= gain <= 7.9
    assert runs[8]["median_itl_ms"] / runs[1]["median_itl_ms"] < 1.25
    assert runs[64]["median_itl_ms"] / runs[1]["median_itl_ms"] > 1.5


def test_a6000_peak_then_drop_past_max_num_seqs() -> None:
    # R4: throughput peaks at c=256 (= default max_num_seqs) and TTFT p95 explodes at c=512.
    points = {p.workload.concurrency: p for p in reference_points() if p.case == "R4"}
    runs = {c: predict(points[c].cfg, points[c].workload, points[c].duration_s) for c in (256, 512)}
    assert runs[512]["p95_ttft_ms"] > 3 * runs[256]["p95_ttft_ms"]
    assert runs[512]["output_throughput"] <= runs[256]["output_throughput"] * 1.02


def test_h100_small_model_saturated_vs_unsaturated() -> None:
    # R11: at rate=inf TTFT is seconds (queueing), at 16 req/s tens of milliseconds; TPOT rises with load.
    points = [p for p in reference_points() if p.case == "R11"]
    low, high = (predict(p.cfg, p.workload, p.duration_s) for p in points)
    assert high["mean_ttft_ms"] > 30 * low["mean_ttft_ms"]
    assert high["mean_tpot_ms"] > low["mean_tpot_ms"]
    assert high["request_throughput"] > 5 * low["request_throughput"]
