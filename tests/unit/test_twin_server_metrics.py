"""The twin's /metrics exposition parses as Prometheus text with vLLM's names, labels and buckets."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchtune.twin.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    CacheConfigInfo,
    VllmMetrics,
    build_1_2_5_buckets,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture
def samples():
    metrics = VllmMetrics(MODEL, max_model_len=8192, cache_info=CacheConfigInfo(16, 27000, 0.9, kv_cache_size_tokens=432000),
                          legacy_gpu_cache_usage=True)  # fmt: skip
    metrics.set_scheduler_state(running=3, waiting=1, kv_usage=0.25)
    metrics.observe_step(prompt_tokens=100, generation_tokens=3, preempted=1)
    metrics.observe_request_start(128)
    metrics.time_to_first_token.observe(0.03)
    metrics.inter_token_latency.observe(0.012)
    metrics.observe_finished(finished_reason="length", prompt_tokens=100, generation_tokens=128, e2e_s=1.6,
                             queue_s=0.01, prefill_s=0.02, decode_s=1.5)  # fmt: skip
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _one(samples, name, **labels):
    matches = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        pytest.param("vllm:num_requests_running", 3, id="running"),
        pytest.param("vllm:num_requests_waiting", 1, id="waiting"),
        pytest.param("vllm:kv_cache_usage_perc", 0.25, id="kv"),
        pytest.param("vllm:gpu_cache_usage_perc", 0.25, id="legacy-kv"),
        pytest.param("vllm:num_preemptions_total", 1, id="preemptions"),
        pytest.param("vllm:prompt_tokens_total", 100, id="prompt-tokens"),
        pytest.param("vllm:generation_tokens_total", 3, id="generation-tokens"),
    ],
)
def test_series_carry_vllm_labels(samples, name, value):
    s = _one(samples, name)
    assert s.labels == {"model_name": MODEL, "engine": "0"}
    assert s.value == value


def test_request_success_has_finished_reason(samples):
    assert _one(samples, "vllm:request_success_total", finished_reason="length").value == 1
    assert _one(samples, "vllm:request_success_total", finished_reason="stop").value == 0


@pytest.mark.parametrize(
    ("name", "buckets"),
    [
        pytest.param("vllm:time_to_first_token_seconds", TTFT_BUCKETS, id="ttft"),
        pytest.param("vllm:inter_token_latency_seconds", ITL_BUCKETS, id="itl"),
        pytest.param("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS, id="e2e"),
        pytest.param("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS, id="queue"),
        pytest.param("vllm:iteration_tokens_total", (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
                     id="iteration-tokens"),  # fmt: skip
    ],
)
def test_histogram_buckets_match_vllm(samples, name, buckets):
    les = [s.labels["le"] for s in samples[name + "_bucket"]]
    assert les == [str(float(b)) for b in buckets] + ["+Inf"]


def test_reference_bucket_lists():
    assert TTFT_BUCKETS[:4] == (0.001, 0.005, 0.01, 0.02) and TTFT_BUCKETS[-1] == 2560.0
    assert ITL_BUCKETS[:3] == (0.01, 0.025, 0.05) and ITL_BUCKETS[-1] == 80.0
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_observations_land_in_buckets(samples):
    assert _one(samples, "vllm:inter_token_latency_seconds_bucket", le="0.025").value == 1
    assert _one(samples, "vllm:inter_token_latency_seconds_bucket", le="0.01").value == 0
    assert _one(samples, "vllm:time_to_first_token_seconds_count").value == 1


def test_cache_config_info(samples):
    s = _one(samples, "vllm:cache_config_info")
    assert s.value == 1
    assert s.labels["num_gpu_blocks"] == "27000"
    assert s.labels["block_size"] == "16"
    assert s.labels["gpu_memory_utilization"] == "0.9"
    assert s.labels["engine"] == "0"


@pytest.mark.parametrize(
    ("limit", "expected"),
    [pytest.param(10, (1, 2, 5, 10), id="ten"), pytest.param(4096, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000), id="4096")],
)
def test_1_2_5_buckets(limit, expected):
    assert build_1_2_5_buckets(limit) == expected
