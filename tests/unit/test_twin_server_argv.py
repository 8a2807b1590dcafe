"""Argv handling of `batchtune twin vllm` / `twin serve`: launcher forms, twin flags, bind address, bench flags."""

from __future__ import annotations

import math

import pytest

from batchtune.twin.cli_serve import bind_host, split_twin_flags
from batchtune.twin.cli_vllm import bench_spec, classify


@pytest.mark.parametrize(
    ("argv", "kind", "rest"),
    [
        pytest.param(["vllm", "serve", "m", "--max-num-seqs", "8"], "serve", ["m", "--max-num-seqs", "8"], id="vllm-serve"),
        pytest.param(["/usr/local/bin/vllm", "serve", "m"], "serve", ["m"], id="vllm-by-path"),
        pytest.param(["serve", "m"], "serve", ["m"], id="serve"),
        pytest.param(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "serve",
                     ["--model", "m"], id="api-server"),  # fmt: skip
        pytest.param(["vllm", "bench", "serve", "--num-prompts", "5"], "bench", ["--num-prompts", "5"], id="bench"),
    ],
)
def test_classify(argv, kind, rest):
    assert classify(argv) == (kind, rest)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param([], id="empty"),
        pytest.param(["vllm", "chat"], id="unknown-subcommand"),
        pytest.param(["python3", "train.py"], id="other-python"),
    ],
)
def test_classify_refuses(argv):
    with pytest.raises(ValueError, match="vLLM|python"):
        classify(argv)


def test_twin_flags_come_out_anywhere_and_env_gives_time_scale(monkeypatch):
    monkeypatch.setenv("BATCHTUNE_TIME_SCALE", "20")
    flags, rest = split_twin_flags(["m", "--twin-gpu", "H100-SXM", "--max-num-seqs", "8", "--twin-load-seconds=0"])
    assert flags.gpu == "H100-SXM" and flags.time_scale == 20.0 and flags.load_seconds == 0.0
    assert rest == ["m", "--max-num-seqs", "8"]
    flags, _ = split_twin_flags(["m", "--time-scale", "3"])
    assert flags.time_scale == 3.0  # the flag wins over the env


@pytest.mark.parametrize("value", [pytest.param("0", id="zero"), pytest.param("fast", id="not-a-number")])
def test_bad_time_scale_is_named(monkeypatch, value):
    monkeypatch.setenv("BATCHTUNE_TIME_SCALE", value)
    with pytest.raises(ValueError, match="time scale|BATCHTUNE_TIME_SCALE"):
        split_twin_flags(["m"])


@pytest.mark.parametrize(
    ("pod_ip", "host", "expected"),
    [
        pytest.param("127.0.3.4", "0.0.0.0", "127.0.3.4", id="pod-ip-wins"),
        pytest.param("", None, "127.0.0.1", id="default-loopback"),
        pytest.param("", "0.0.0.0", "127.0.0.1", id="any-narrowed"),
        pytest.param("", "127.0.0.9", "127.0.0.9", id="explicit"),
    ],
)
def test_bind_host(monkeypatch, pod_ip, host, expected):
    monkeypatch.setenv("BATCHTUNE_POD_IP", pod_ip)
    assert bind_host(host) == expected


def test_vllm_flag_forms_reach_the_config():
    from batchtune.twin.config import parse_vllm_argv

    _, rest = split_twin_flags(["meta-llama/Llama-3.1-8B-Instruct", "--max_num_seqs=32", "--gpu-memory-utilization",
                                "0.85", "--port", "9000", "--twin-gpu", "H100-SXM", "--no-enable-chunked-prefill"])  # fmt: skip
    parsed = parse_vllm_argv(rest)
    cfg = parsed.to_config("H100-SXM")
    assert (cfg.max_num_seqs, cfg.gpu_memory_utilization, cfg.enable_chunked_prefill) == (32, 0.85, False)
    assert parsed.port == 9000


def test_bench_flags_map_to_the_load_spec(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHTUNE_TIME_SCALE", "4")
    spec, result_file = bench_spec(
        ["--host", "127.0.0.5", "--port", "8001", "--model", "m", "--dataset-name", "random", "--random-input-len",
         "256", "--random_output_len=64", "--num-prompts", "50", "--max-concurrency", "8", "--ignore-eos",
         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", "--percentile-metrics",
         "ttft,itl", "--metric-percentiles", "50,99", "--goodput", "ttft:100"],  # fmt: skip
        log=lambda _m: None,
    )
    assert spec.base_url == "http://127.0.0.5:8001" and spec.model == "m"
    assert (spec.input_len, spec.output_len, spec.num_prompts, spec.concurrency) == (256, 64, 50, 8)
    assert math.isinf(spec.request_rate) and spec.time_scale == 4.0
    assert spec.percentile_metrics == ("ttft", "itl") and spec.percentiles == (50.0, 99.0)
    assert result_file == str(tmp_path / "r.json")


def test_bench_chat_backend_uses_chat_endpoint():
    spec, result_file = bench_spec(["--backend", "openai-chat", "--base-url", "http://127.0.0.1:9"], log=lambda _m: None)
    assert spec.endpoint == "/v1/chat/completions" and result_file is None
