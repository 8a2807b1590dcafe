"""`predict` and `batchtune twin predict`: keys, determinism, open/closed loop, bench mode, CLI exit codes."""

from __future__ import annotations

import json
import math

import pytest

from batchtune.cli import main
from batchtune.twin.config import ServeConfig
from batchtune.twin.predict import Workload, predict

CFG = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="NVIDIA-A100-SXM4-80GB")
BENCH_KEYS = ["request_throughput", "output_throughput", "total_token_throughput", "completed", "failed", "duration",
              *(f"{s}_{m}_ms" for m in ("ttft", "itl", "tpot", "e2el") for s in ("mean", "median", "p50", "p90",
                                                                                   "p95", "p99")),
              "gpu_util_pct", "sm_active_pct", "kv_cache_usage_pct", "preemptions_per_s", "fb_used_mib", "power_w",
              "tokens_per_joule"]


def test_prediction_has_vllm_bench_keys() -> None:
    data = predict(CFG, Workload(512, 128, concurrency=16), 20).as_dict()
    missing = [k for k in BENCH_KEYS if k not in data]
    assert not missing
    assert data["p99_itl_ms"] >= data["p95_itl_ms"] >= data["median_itl_ms"] > 0
    assert math.isclose(data["output_throughput"] * data["duration"], data["total_output_tokens"])


def test_same_seed_is_deterministic_and_seed_matters_for_poisson() -> None:
    wl = Workload(512, 128, request_rate=8.0, length_dist="uniform")
    a, b, c = (predict(CFG, wl, 20, seed=s).as_dict() for s in (1, 1, 2))
    assert a == b and a != c


def test_poisson_throughput_follows_offered_rate_below_saturation() -> None:
    p = predict(CFG, Workload(256, 64, request_rate=4.0), 120, seed=5)
    assert 3.4 < p["request_throughput"] < 4.6


def test_bench_mode_completes_all_prompts() -> None:
    p = predict(CFG, Workload(256, 32, concurrency=8, num_prompts=40), 600)
    assert p["completed"] == 40 and p["total_output_tokens"] == 40 * 32


def test_noise_is_seeded_and_multiplicative() -> None:
    wl = Workload(512, 128, concurrency=8)
    clean = predict(CFG, wl, 20)
    noisy, again = predict(CFG, wl, 20, noise=0.05, seed=0), predict(CFG, wl, 20, noise=0.05, seed=0)
    assert noisy.as_dict() == again.as_dict()
    ratio = noisy["output_throughput"] / clean["output_throughput"]
    assert ratio != 1.0 and 0.7 < ratio < 1.3
    assert math.isclose(noisy["request_throughput"] / clean["request_throughput"], ratio)


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(input_len=10, output_len=10), id="no-load-shape"),
    pytest.param(dict(input_len=10, output_len=10, concurrency=2, request_rate=1.0), id="both"),
    pytest.param(dict(input_len=0, output_len=10, concurrency=2), id="zero-input"),
    pytest.param(dict(input_len=10, output_len=10, request_rate=math.inf), id="inf-without-num-prompts"),
])
def test_workload_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Workload(**kwargs)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["twin", "predict", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "NVIDIA-L40S", "--max-num-seqs",
               "64", "--gpu-memory-utilization", "0.9", "--max-model-len", "8192", "--input-len", "256",
               "--output-len", "64", "--concurrency", "16", "--duration", "10", "-o", "json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["max_num_seqs"] == 64 and data["output_throughput"] > 0 and data["gpu"] == "L40S"


def test_cli_table_and_startup_error_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["twin", "predict", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-L4",
               "--max-num-seqs", "32", "--gpu-memory-utilization", "0.9", "--input-len", "256", "--output-len", "64",
               "--rate", "2", "--duration", "10"])
    captured = capsys.readouterr()
    assert rc == 1 and "model's max seq len (131072)" in captured.err


def test_cli_unknown_gpu_lists_known(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["twin", "predict", "--model", "Llama-3.1-8B", "--gpu", "B300", "--input-len", "1", "--output-len", "1",
               "--concurrency", "1"])
    assert rc == 2 and "H100-SXM" in capsys.readouterr().err
