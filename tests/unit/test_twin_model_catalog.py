"""Catalog lookups, vLLM argv parsing and the memory plan (startup failures with vLLM's text)."""

from __future__ import annotations

import pytest

from batchtune.twin.catalog import (
    UnknownGpu,
    UnknownModel,
    get_gpu,
    get_model,
    gpu_from_product_label,
    load_custom_catalog,
)
from batchtune.twin.config import ServeConfig, parse_vllm_argv
from batchtune.twin.memory import StartupFailure, plan_memory


@pytest.mark.parametrize("label,name", [
    pytest.param("NVIDIA-H100-80GB-HBM3", "H100-SXM", id="h100-sxm"),
    pytest.param("NVIDIA-H100-PCIe", "H100-PCIe", id="h100-pcie"),
    pytest.param("NVIDIA-A100-SXM4-80GB", "A100-80GB", id="a100-80"),
    pytest.param("NVIDIA-A100-SXM4-40GB", "A100-40GB", id="a100-40"),
    pytest.param("NVIDIA-L4", "L4", id="l4"),
    pytest.param("NVIDIA-L40S", "L40S", id="l40s"),
    pytest.param("NVIDIA-A10G", "A10G", id="a10g"),
    pytest.param("NVIDIA-RTX-A6000", "A6000", id="a6000"),
    pytest.param("NVIDIA-GeForce-RTX-4090", "RTX-4090", id="4090"),
    pytest.param("NVIDIA-H200", "H200", id="h200"),
    pytest.param("NVIDIA-L4-SHARED", "L4", id="time-sliced-suffix"),
    pytest.param("NVIDIA H100 80GB HBM3", "H100-SXM", id="dcgm-modelName"),
])
def test_gpu_from_product_label(label: str, name: str) -> None:
    assert gpu_from_product_label(label).name == name


@pytest.mark.parametrize("name,expected", [
    pytest.param("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B", id="hf-instruct"),
    pytest.param("Llama-3.1-70B", "Llama-3.1-70B", id="short"),
    pytest.param("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B", id="mistral"),
    pytest.param("Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B", id="qwen-small"),
    pytest.param("/models/Qwen/Qwen3-0.6B", "Qwen3-0.6B", id="local-path"),
    pytest.param("meta-llama/Llama-2-7b-chat-hf", "Llama-2-7B", id="llama2"),
])
def test_get_model_accepts_hf_ids_and_short_names(name: str, expected: str) -> None:
    assert get_model(name).name == expected


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(UnknownGpu) as gpu_err:
        get_gpu("TPU-v5e")
    assert "TPU-v5e" in str(gpu_err.value) and "H100-SXM" in str(gpu_err.value)
    with pytest.raises(UnknownModel) as model_err:
        get_model("gpt-5")
    assert "Llama-3.1-8B" in str(model_err.value)


def test_custom_catalog_adds_entries(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "catalog.yaml"
    path.write_text("""
gpus:
  - {name: MI300X-test, memory_gib: 191.5, bandwidth_gbps: 5300, bf16_tflops: 1307, fp8_tflops: 2615,
     tdp_w: 750, idle_w: 90, product_labels: [AMD-MI300X-test]}
models:
  - {name: Tiny-1B-test, hf_ids: [acme/tiny-1b-test], params_b: 1.0, num_layers: 16, hidden_size: 2048,
     num_heads: 16, num_kv_heads: 4, head_dim: 128, intermediate_size: 8192, vocab_size: 32000, max_model_len: 8192}
""")
    load_custom_catalog(path)
    cfg = ServeConfig(model="acme/tiny-1b-test", gpu="AMD-MI300X-test")
    assert plan_memory(cfg).kv_cache_tokens > 100_000


def test_custom_catalog_rejects_unknown_fields(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.yaml"
    path.write_text("gpus:\n  - {name: X, memory_gib: 1, colour: red}\n")
    with pytest.raises(ValueError, match="colour"):
        load_custom_catalog(path)


@pytest.mark.parametrize("argv,field,value", [
    pytest.param(["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--max-num-seqs", "64"], "max_num_seqs", 64,
                 id="vllm-serve"),
    pytest.param(["serve", "Qwen/Qwen2.5-7B-Instruct", "--gpu-memory-utilization=0.85"], "gpu_memory_utilization",
                 0.85, id="equals-form"),
    pytest.param(["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-0.6B",
                  "--max_num_batched_tokens", "4096"], "max_num_batched_tokens", 4096, id="api-server-underscores"),
    pytest.param(["vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct", "-tp", "4"], "tensor_parallel_size", 4,
                 id="short-tp"),
    pytest.param(["vllm", "serve", "Qwen/Qwen3-0.6B", "--no-enable-chunked-prefill", "--max-num-batched-tokens",
                  "40960"], "enable_chunked_prefill", False, id="no-chunked"),
])
def test_from_vllm_argv(argv: list[str], field: str, value: object) -> None:
    cfg = ServeConfig.from_vllm_argv(argv, gpu="NVIDIA-H100-80GB-HBM3")
    assert getattr(cfg, field) == value


def test_argv_server_flags_and_unknown_flags() -> None:
    seen: list[str] = []
    parsed = parse_vllm_argv(["vllm", "serve", "Qwen/Qwen3-0.6B", "--port", "8001", "--host", "0.0.0.0",
                              "--served-model-name", "q", "--trust-remote-code", "--swap-space", "4"],
                             on_unknown=seen.append)
    assert (parsed.port, parsed.host, parsed.served_model_name) == (8001, "0.0.0.0", "q")
    assert parsed.unknown == ("--trust-remote-code", "--swap-space 4") and seen == list(parsed.unknown)


@pytest.mark.parametrize("gpu,seqs,tokens", [
    pytest.param("H100", 1024, 8192, id="big-non-a100"),
    pytest.param("A100-80GB", 256, 2048, id="a100-excluded"),
    pytest.param("L4", 256, 2048, id="small"),
])
def test_vllm_hardware_defaults(gpu: str, seqs: int, tokens: int) -> None:
    cfg = ServeConfig(model="Llama-3.1-8B", gpu=gpu)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (seqs, tokens)


@pytest.mark.parametrize("model,kib", [
    pytest.param("Llama-3.1-8B", 128, id="llama3-8b"), pytest.param("Llama-3.1-70B", 320, id="llama3-70b"),
    pytest.param("Mistral-7B", 128, id="mistral"), pytest.param("Qwen2.5-7B", 56, id="qwen2.5-7b"),
    pytest.param("Llama-2-7B", 512, id="llama2-mha"),
])
def test_kv_bytes_per_token_match_reference(model: str, kib: int) -> None:
    assert ServeConfig(model=model, gpu="H100").kv_bytes_per_token == kib * 1024


@pytest.mark.parametrize("gpu,low,high", [
    pytest.param("H100", 400_000, 470_000, id="h100"),
    pytest.param("A100-80GB", 400_000, 470_000, id="a100-80"),
    pytest.param("A100-40GB", 130_000, 165_000, id="a100-40"),
])
def test_kv_capacity_near_reference_worked_examples(gpu: str, low: int, high: int) -> None:
    plan = plan_memory(ServeConfig(model="Llama-3.1-8B", gpu=gpu, gpu_memory_utilization=0.9))
    assert low <= plan.kv_cache_tokens <= high
    assert plan.num_gpu_blocks * plan.block_size == plan.kv_cache_tokens


def test_kv_pool_grows_with_utilization_and_shrinks_with_token_budget() -> None:
    base = dict(model="Llama-3.1-8B", gpu="H100")
    low, high = (plan_memory(ServeConfig(**base, gpu_memory_utilization=u)).kv_cache_tokens for u in (0.8, 0.95))
    assert high > low
    small, big = (plan_memory(ServeConfig(**base, max_num_batched_tokens=t)).kv_cache_tokens for t in (2048, 32768))
    assert small > big  # the profiled activation peak grows with the token budget


def test_weights_by_dtype_and_tensor_parallel() -> None:
    bf16 = plan_memory(ServeConfig(model="Llama-3.1-70B", gpu="H100", tensor_parallel_size=4,
                                   max_model_len=8192)).weights_gib
    fp8 = plan_memory(ServeConfig(model="Llama-3.1-70B", gpu="H100", tensor_parallel_size=4, quantization="fp8",
                                  max_model_len=8192)).weights_gib
    awq = plan_memory(ServeConfig(model="Llama-3.1-70B", gpu="H100", tensor_parallel_size=4, quantization="awq",
                                  max_model_len=8192)).weights_gib
    assert 31 < bf16 < 35 and 0.45 < fp8 / bf16 < 0.6 and awq < fp8


def test_startup_log_lines() -> None:
    lines = plan_memory(ServeConfig(model="Llama-3.1-8B", gpu="L4", max_model_len=8192)).log_lines()
    assert any(line.startswith("GPU KV cache size: ") and line.endswith(" tokens") for line in lines)
    assert any(line.startswith("Maximum concurrency for 8,192 tokens per request: ") for line in lines)


@pytest.mark.parametrize("kwargs,text", [
    pytest.param(dict(model="Llama-3.1-8B", gpu="L4"),
                 "To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is "
                 "needed, which is larger than the available KV cache memory", id="max-model-len-does-not-fit"),
    pytest.param(dict(model="Llama-3.1-8B", gpu="L4", gpu_memory_utilization=0.5),
                 "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", id="no-kv"),
    pytest.param(dict(model="Llama-3.1-8B", gpu="A100-40GB", gpu_memory_utilization=0.99),
                 "on startup is less than desired GPU memory utilization (0.99, ", id="free-memory"),
    pytest.param(dict(model="Llama-3.1-8B", gpu="H100", max_num_seqs=512, max_num_batched_tokens=256),
                 "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512).",
                 id="budget-below-seqs"),
    pytest.param(dict(model="Llama-3.1-70B", gpu="H100", max_model_len=8192),
                 "CUDA out of memory. Tried to allocate", id="70b-weights-do-not-fit"),
])
def test_startup_failures_carry_vllm_text(kwargs: dict, text: str) -> None:
    with pytest.raises(StartupFailure) as err:
        plan_memory(ServeConfig(**kwargs))
    assert text in str(err.value)
    assert str(err.value).startswith(("ValueError: ", "torch.OutOfMemoryError: "))


def test_estimated_max_model_len_fits() -> None:
    with pytest.raises(StartupFailure) as err:
        plan_memory(ServeConfig(model="Llama-3.1-8B", gpu="L4"))
    estimate = int(str(err.value).split("estimated maximum model length is ")[1].split(".")[0])
    assert plan_memory(ServeConfig(model="Llama-3.1-8B", gpu="L4", max_model_len=estimate)).kv_cache_tokens >= estimate


@pytest.mark.parametrize("gmu,tokens,oom", [
    pytest.param(0.90, 8192, False, id="default-headroom"),
    pytest.param(0.97, 2048, False, id="high-util-small-budget"),
    pytest.param(0.97, 8192, True, id="high-util-large-budget"),
    pytest.param(0.98, 2048, True, id="too-high-util"),
])
def test_runtime_oom_rule(gmu: float, tokens: int, oom: bool) -> None:
    plan = plan_memory(ServeConfig(model="Llama-3.1-8B", gpu="A100-40GB", gpu_memory_utilization=gmu,
                                   max_num_batched_tokens=tokens))
    assert plan.runtime_oom_risk is oom
