"""TwinParams: the nominal twin is unchanged, each deployment figure moves what it should, and it round-trips."""

from __future__ import annotations

import math

import pytest

from batchtune.twin.config import ServeConfig
from batchtune.twin.memory import plan_memory
from batchtune.twin.params import NOMINAL, GenericStepModel, TwinParams
from batchtune.twin.predict import Workload, predict

CFG = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_num_seqs=64)
WL = Workload(512, 128, concurrency=16)


def test_nominal_params_are_the_catalog_twin() -> None:
    assert predict(CFG, WL, 10, params=TwinParams()).metrics == predict(CFG, WL, 10).metrics
    assert plan_memory(CFG, NOMINAL) == plan_memory(CFG)
    assert NOMINAL.nominal and not NOMINAL.replace(bw_scale=0.9).nominal


@pytest.mark.parametrize(("change", "key", "direction"), [
    pytest.param({"bw_scale": 0.8}, "median_itl_ms", +1, id="less-bandwidth-slower-decode"),
    pytest.param({"step_overhead_s": 0.003}, "median_itl_ms", +1, id="cpu-overhead-slower-steps"),
    pytest.param({"flops_scale": 0.5}, "median_ttft_ms", +1, id="less-compute-slower-prefill"),
    pytest.param({"response_path_s": 0.05}, "median_ttft_ms", +1, id="response-path-in-ttft"),
    # the mean: a closed loop of fixed lengths prefills in waves, whose median request sits where the wave puts it
    pytest.param({"prefill_token_overhead_s": 2e-6}, "mean_ttft_ms", +1, id="prompt-preparation"),
    pytest.param({"kv_read_efficiency": 0.5}, "median_itl_ms", +1, id="slow-kv-reads"),
])
def test_each_figure_moves_its_metric(change: dict[str, float], key: str, direction: int) -> None:
    base = predict(CFG, WL, 10)[key]
    moved = predict(CFG, WL, 10, params=TwinParams(**change))[key]
    assert (moved - base) * direction > 0.05 * base


def test_memory_offset_shrinks_the_pool_by_exactly_that() -> None:
    base, less = plan_memory(CFG), plan_memory(CFG, TwinParams(memory_offset_gib=1.0))
    assert math.isclose(base.kv_cache_gib - less.kv_cache_gib, 1.0, rel_tol=1e-9)
    short = CFG.replace(max_model_len=4096)
    assert plan_memory(short, TwinParams(kv_pool_tokens=8192)).kv_cache_tokens == 8192


def test_runtime_oom_margin_and_activation_scale_move_the_oom_step() -> None:
    tight = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="A100-40GB", gpu_memory_utilization=0.97,
                        max_num_batched_tokens=8192)
    nominal = plan_memory(tight).runtime_oom_tokens
    worse = plan_memory(tight, TwinParams(runtime_fragment_fraction=0.8)).runtime_oom_tokens
    assert nominal is not None and worse is not None and worse < nominal


def test_one_prefill_per_step_queues_arrivals_faster_than_steps() -> None:
    busy = Workload(128, 64, request_rate=150.0)
    cfg = CFG.replace(max_num_seqs=256)
    free = predict(cfg, busy, 20)["p95_ttft_ms"]
    one = predict(cfg, busy, 20, params=TwinParams(max_prefills_per_step=1))["p95_ttft_ms"]
    assert one > 3 * free


def test_generic_step_model_replaces_the_roofline() -> None:
    generic = TwinParams(generic=GenericStepModel(0.01, 0.0, 0.0))
    p = predict(CFG, Workload(128, 64, concurrency=1), 10, params=generic)
    assert p["median_itl_ms"] == pytest.approx(10.0, rel=1e-6)


def test_round_trip_and_field_named_errors() -> None:
    params = TwinParams(bw_scale=0.9, memory_offset_gib=-0.5, generic=GenericStepModel(0.002, 1e-5, 1e-6))
    assert TwinParams.from_dict(params.as_dict()) == params
    assert TwinParams().as_dict() == {}
    with pytest.raises(ValueError, match="unknown key.*'bw'"):
        TwinParams.from_dict({"bw": 1.0})
    with pytest.raises(ValueError, match="bw_scale must be > 0"):
        TwinParams(bw_scale=0.0)
    with pytest.raises(ValueError, match="step_overhead_s must be a finite number"):
        TwinParams.from_dict({"step_overhead_s": "fast"})
    with pytest.raises(ValueError, match="generic: unknown key"):
        TwinParams.from_dict({"generic": {"fixed_s": 0.01, "slope": 1}})
