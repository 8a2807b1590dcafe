"""Shapes the twin must show: the knee, rising ITL, the TTFT cliff, the preemption cliff, startup
failures and the runtime-OOM rule that makes the largest gpu_memory_utilization not always best."""

from __future__ import annotations

import pytest

from batchtune.twin.config import ServeConfig
from batchtune.twin.predict import Workload, predict

H100_8B = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="NVIDIA-H100-80GB-HBM3", max_num_seqs=128)
CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def sweep() -> dict:
    return {c: predict(H100_8B, Workload(512, 128, concurrency=c), 30) for c in CONCURRENCIES}


def test_throughput_rises_then_flattens(sweep: dict) -> None:
    tput = [sweep[c]["output_throughput"] for c in CONCURRENCIES]
    for lo, hi in zip(tput, tput[1:], strict=False):
        assert hi >= lo * 0.97, tput  # monotone up to simulation noise
    assert tput[3] / tput[0] > 6  # near-linear at small batch
    assert tput[-1] / tput[-2] < 1.1  # flat once concurrency exceeds max_num_seqs


def test_itl_rises_with_concurrency(sweep: dict) -> None:
    itl = [sweep[c]["median_itl_ms"] for c in CONCURRENCIES]
    assert itl[-2] > 1.5 * itl[0] and all(b >= a * 0.98 for a, b in zip(itl, itl[1:], strict=False))
    assert sweep[128]["mean_itl_ms"] > 2 * sweep[1]["mean_itl_ms"]  # prefill-carrying steps stretch the mean


def test_ttft_blows_up_past_max_num_seqs(sweep: dict) -> None:
    assert sweep[256]["median_ttft_ms"] > 5 * sweep[64]["median_ttft_ms"]


def test_gpu_util_is_busy_fraction_and_fb_is_flat(sweep: dict) -> None:
    assert all(sweep[c]["gpu_util_pct"] > 95 for c in CONCURRENCIES)
    assert sweep[256]["sm_active_pct"] > sweep[1]["sm_active_pct"]
    assert len({sweep[c]["fb_used_mib"] for c in CONCURRENCIES}) == 1
    assert sweep[256]["power_w"] > sweep[1]["power_w"]


def test_kv_exhaustion_brings_preemptions_and_lower_throughput() -> None:
    workload = Workload(1024, 1024, concurrency=64)
    roomy = ServeConfig(model="Llama-3.1-8B", gpu="A100-40GB", max_model_len=4096, gpu_memory_utilization=0.9,
                        max_num_seqs=64)
    tight = roomy.replace(gpu_memory_utilization=0.6)
    a, b = predict(roomy, workload, 120), predict(tight, workload, 120)
    assert a["preemptions_per_s"] == 0 and b["preemptions_per_s"] > 0.5
    assert b["kv_cache_usage_pct"] > 90
    assert b["output_throughput"] < a["output_throughput"]


def test_setting_that_does_not_fit_fails_at_startup() -> None:
    p = predict(ServeConfig(model="Llama-3.1-8B", gpu="NVIDIA-L4"), Workload(512, 128, concurrency=8), 10)
    assert not p.ok and p.metrics == {}
    assert "To serve at least one request with the model's max seq len (131072)" in (p.startup_error or "")
    assert "startup_error" in p.as_dict() and "output_throughput" not in p.as_dict()


def test_best_utilization_is_not_always_the_largest() -> None:
    base = ServeConfig(model="Llama-3.1-8B", gpu="A100-40GB", max_num_batched_tokens=8192, max_num_seqs=128)
    workload = Workload(1024, 256, concurrency=128)
    results = {u: predict(base.replace(gpu_memory_utilization=u), workload, 30) for u in (0.85, 0.9, 0.95, 0.97)}
    assert results[0.97].runtime_error and "CUDA out of memory" in results[0.97].runtime_error
    ok = {u: r["output_throughput"] for u, r in results.items() if r.ok}
    assert max(ok, key=ok.get) < 0.97  # type: ignore[arg-type]
