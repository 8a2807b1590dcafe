"""Calibration (`twin.fit`): hidden deployment figures are recovered well enough to predict other settings, the
memory outside the KV pool comes out exact, a model missing from the catalog gets a generic fit, and the
verdict and the prediction check say when the twin misses."""

from __future__ import annotations

import math

import pytest

from batchtune.twin.catalog import ModelSpec
from batchtune.twin.config import ServeConfig
from batchtune.twin.fit import Observation, calibrate, check, simulate, targets
from batchtune.twin.memory import plan_memory
from batchtune.twin.params import TwinParams
from batchtune.twin.steady import Shape

L8 = "meta-llama/Llama-3.1-8B-Instruct"
CFG = ServeConfig(model=L8, gpu="H100", max_num_seqs=128)
SHAPE = Shape(512, 256)
MEASURED = ("request_throughput", "output_throughput", "p95_ttft_ms", "p95_itl_ms", "p95_e2el_ms",
            "mean_running_requests")


def measure(truth: TwinParams, cfg: ServeConfig, rate: float, seed: int = 3) -> Observation:
    raw = simulate(Observation(cfg, SHAPE, {}, rate=rate, window_s=60), truth, seed)
    return Observation(cfg, SHAPE, {k: raw[k] for k in MEASURED}, rate=rate, window_s=60,
                       kv_pool_tokens=plan_memory(cfg, truth).kv_cache_tokens, source=f"rate {rate}")


@pytest.fixture(scope="module")
def hidden() -> TwinParams:
    # Slower than the catalog in every figure, plus a cost the twin has no parameter for.
    return TwinParams(bw_scale=0.9, flops_scale=0.8, step_overhead_s=0.0012, seq_overhead_s=20e-6,
                      memory_offset_gib=0.7, prefill_token_overhead_s=0.3e-6)


@pytest.fixture(scope="module")
def fitted(hidden: TwinParams):  # noqa: ANN201
    return calibrate([measure(hidden, CFG, r) for r in (5.0, 15.0, 22.0)])


def test_calibration_reproduces_its_measurements(fitted) -> None:  # noqa: ANN001
    assert fitted.kind == "catalog" and fitted.observations == 3
    assert fitted.trusted, fitted.reason
    assert fitted.params.memory_offset_gib == pytest.approx(0.7, abs=0.01)


def test_calibrated_twin_predicts_a_setting_it_never_saw(hidden: TwinParams, fitted) -> None:  # noqa: ANN001
    other = Observation(CFG.replace(max_num_seqs=256), SHAPE, {}, rate=26.0, window_s=60)
    truth, calibrated, nominal = (simulate(other, p, seed=5) for p in (hidden, fitted.params, TwinParams()))
    errors = {key: calibrated[key] / truth[key] - 1 for key in ("median_itl_ms", "mean_itl_ms", "mean_running_requests",
                                                               "p95_e2el_ms")}
    assert all(abs(e) < 0.10 for e in errors.values()), errors
    assert abs(nominal["mean_itl_ms"] / truth["mean_itl_ms"] - 1) > 0.3  # what calibration was for


def test_check_flags_a_measurement_the_twin_misses(hidden: TwinParams, fitted) -> None:  # noqa: ANN001
    new = measure(hidden, CFG.replace(max_num_seqs=64), 12.0, seed=9)
    assert check(fitted.params, new).agrees
    slower = measure(hidden.replace(bw_scale=0.6), CFG.replace(max_num_seqs=64), 12.0, seed=9)
    agreement = check(fitted.params, slower)
    assert not agreement.agrees
    assert agreement.worst is not None and agreement.worst.family in ("itl", "e2el", "running")


def test_untrusted_when_the_measurements_contradict_the_model() -> None:
    obs = measure(TwinParams(), CFG, 10.0)
    twisted = dict(obs.metrics, p95_itl_ms=obs.metrics["p95_itl_ms"] * 5)  # ITL five times what throughput allows
    result = calibrate([Observation(CFG, SHAPE, twisted, rate=10.0, window_s=60, source="twisted")])
    assert not result.trusted and "outside their tolerance" in result.reason


def test_generic_model_from_measurements_alone() -> None:
    # A "model" the catalog does not have: the twin's own Llama-8B, seen only through its measurements.
    truth_cfg = ServeConfig(model=L8, gpu="H100", max_num_seqs=64)
    obs = []
    for c in (4, 16, 48):
        raw = simulate(Observation(truth_cfg, SHAPE, {}, concurrency=c, window_s=30), TwinParams(), seed=1)
        obs.append({k: raw[k] for k in ("output_throughput", "median_ttft_ms", "median_itl_ms")})
    placeholder = ModelSpec("acme/secret-8b", ("acme/secret-8b",), 1.0, 1, 64, 1, 1, 64, 64, 1024, 131072)
    cfg = ServeConfig(model=placeholder, gpu="H100", max_num_seqs=64, model_id="acme/secret-8b")
    result = calibrate([Observation(cfg, SHAPE, m, concurrency=c, window_s=30, source=f"c{c}")
                        for c, m in zip((4, 16, 48), obs, strict=True)], generic=True)
    assert result.kind == "generic" and result.params.generic is not None
    throughput = [r for r in result.residuals if r.family in ("throughput", "itl")]
    assert throughput and all(abs(r.error) < 0.1 for r in throughput)
    # and it predicts a concurrency between the measured ones
    mid = simulate(Observation(cfg, SHAPE, {}, concurrency=32, window_s=30), result.params)
    real = simulate(Observation(truth_cfg, SHAPE, {}, concurrency=32, window_s=30), TwinParams())
    assert mid["median_itl_ms"] == pytest.approx(real["median_itl_ms"], rel=0.15)


def test_targets_skip_bundled_itl_and_need_a_figure() -> None:
    obs = Observation(CFG, SHAPE, {"output_throughput": 100.0, "median_itl_ms": 0.004, "mean_tpot_ms": 4.5,
                                   "mean_ttft_ms": math.nan}, concurrency=4)
    assert set(targets(obs)) == {"output_throughput", "mean_tpot_ms"}
    with pytest.raises(ValueError, match="no observation has a figure"):
        calibrate([Observation(CFG, SHAPE, {"completed": 3.0}, concurrency=4)])


def test_a_measured_setting_the_memory_model_refuses_is_named() -> None:
    bad = ServeConfig(model=L8, gpu="L4", gpu_memory_utilization=0.95, max_model_len=4096)
    with pytest.raises(ValueError, match="src.*memory model says this setting does not start"):
        calibrate([Observation(bad.replace(gpu_memory_utilization=0.99), SHAPE, {"output_throughput": 10.0},
                               concurrency=1, source="src")])


# ---- physical bounds and what an Untrusted fit says ------------------------------------------------------

WRONG = ServeConfig(model="Llama-3.1-70B", gpu="H100", max_num_seqs=256, max_model_len=4096, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def eight_b_runs() -> list[tuple[int, dict[str, float]]]:
    truth = ServeConfig(model=L8, gpu="H100", max_num_seqs=256, max_model_len=4096)
    shape = Shape(1024, 128, "uniform", 0.1)
    out = []
    for c in (4, 16, 64):
        raw = simulate(Observation(truth, shape, {}, concurrency=c, window_s=30), TwinParams(), seed=1)
        out.append((c, {k: raw[k] for k in ("output_throughput", "median_ttft_ms", "median_itl_ms", "median_e2el_ms")}))
    return out


def test_an_8b_deployments_files_calibrated_as_70b_are_untrusted_at_the_bandwidth_bound(eight_b_runs) -> None:  # noqa: ANN001
    from batchtune.twin.fit import MAX_BANDWIDTH_EFFICIENCY, MAX_COMPUTE_EFFICIENCY

    shape = Shape(1024, 128, "uniform", 0.1)
    honest = calibrate([Observation(WRONG.replace(model=L8, tensor_parallel_size=1), shape, m, concurrency=c,
                                    window_s=30, source=f"c{c}") for c, m in eight_b_runs])
    wrong = calibrate([Observation(WRONG, shape, m, concurrency=c, window_s=30, source=f"c{c}")
                       for c, m in eight_b_runs])
    assert honest.trusted, honest.reason
    assert not wrong.trusted
    gpu = WRONG.gpu
    # never above the device's peak, however much faster the measurements are
    assert gpu.eta_bw * wrong.params.bw_scale <= MAX_BANDWIDTH_EFFICIENCY + 1e-9
    assert gpu.eta_flops * wrong.params.flops_scale <= MAX_COMPUTE_EFFICIENCY + 1e-9
    assert wrong.rms_log_error() > honest.rms_log_error()  # a better fit than the honest one is no longer possible
    assert {(b.name, b.side) for b in wrong.bounds} >= {("bw_scale", "upper")}
    assert "memory bandwidth 95% of H100-SXM" in wrong.reason and "a smaller model" in wrong.reason
    assert "--tensor-parallel-size" in wrong.reason and "--quantization" in wrong.reason


def test_compute_is_bounded_when_a_ttft_cannot_be_reproduced() -> None:
    from batchtune.twin.fit import MAX_COMPUTE_EFFICIENCY

    obs = measure(TwinParams(), CFG, 10.0)
    fast = dict(obs.metrics, p95_ttft_ms=obs.metrics["p95_ttft_ms"] * 0.1)  # prompts ten times faster than physics
    result = calibrate([Observation(CFG, SHAPE, fast, rate=10.0, window_s=60, source="fast")])
    assert CFG.gpu.eta_flops * result.params.flops_scale <= MAX_COMPUTE_EFFICIENCY + 1e-9
    assert not result.trusted
    assert "p95_ttft_ms" in result.reason


def test_a_kv_pool_larger_than_the_gpu_leaves_contradicts_the_inputs() -> None:
    obs = measure(TwinParams(), CFG, 10.0)
    impossible = Observation(CFG, SHAPE, obs.metrics, rate=10.0, window_s=60, source="big-pool",
                             kv_pool_tokens=2 * plan_memory(CFG).kv_cache_tokens)
    result = calibrate([impossible])
    assert not result.trusted
    assert result.contradictions and "big-pool: the measured KV pool" in result.reason
    assert "not the one measured" in result.reason
    # the same measurement with its real pool is trusted
    assert calibrate([obs]).trusted
