"""GPU memory plan of a vLLM V1 engine: weights, profiled activation peak, CUDA graphs, the KV pool.

Follows `gpu_worker.determine_available_memory` and `kv_cache_utils`:
  requested     = total x gpu_memory_utilization                 (total, not free, memory)
  KV pool       = requested - weights - activation peak - non-torch - CUDA-graph estimate
  blocks        = KV pool // (block_size x KV bytes per token)
Startup failures carry vLLM's own message text. See docs/twin.md for the equations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchtune.twin.catalog import GIB, MIB
from batchtune.twin.config import ServeConfig
from batchtune.twin.params import NOMINAL, TwinParams

CUDA_CONTEXT_GIB = 0.5
"""CUDA context + cuBLAS workspace, allocated before vLLM measures free memory (outside the budget)."""
NON_TORCH_GIB = 0.2
"""Non-torch allocations vLLM's profiler sees (allocator, NCCL off)."""
NCCL_GIB = 0.3
"""Extra non-torch memory with tensor parallelism (NCCL buffers)."""
CUDAGRAPH_MIB_PER_SIZE_LAYER = 0.25
"""CUDA-graph pool growth per captured batch size per layer (piecewise graphs)."""

DOCS_URL = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"

CPU_STARTUP_USED_GIB = 1.85
"""CPU backend: node memory not available when the worker checks `gpu_memory_utilization` (the OS, vLLM's own
API-server and engine-core processes). Measured on the 2-core build machine with nothing else running:
15.25 of 17.09 GiB available (tests/data/golden/vllm-0.32.0-cpu). Other pods on the node take more."""
CPU_WORKER_BASE_GIB = 0.85
"""CPU backend: the worker's resident memory besides the KV cache and the weights (torch, oneDNN, the
runner); vLLM subtracts the worker's RSS from the requested share (0.91 GiB measured with the tiny model)."""


def format_gib(num_bytes: float) -> str:
    """vLLM's `format_gib`: GiB rounded to 2 decimals, printed as Python prints the float (`80.0`, `1.5`)."""
    return f"{round(num_bytes / GIB, 2)}"


class StartupFailure(Exception):
    """vLLM failed to start: `message` is vLLM's own text, `exc_type` the Python exception it raised."""

    def __init__(self, message: str, exc_type: str = "ValueError"):
        super().__init__(message)
        self.message = message
        self.exc_type = exc_type

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}"


class RuntimeOutOfMemory(Exception):
    """The engine booted but ran out of GPU memory under load (torch.OutOfMemoryError)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"torch.OutOfMemoryError: {self.message}"


def cudagraph_capture_sizes(cfg: ServeConfig) -> list[int]:
    """vLLM `_set_cudagraph_sizes`: [1, 2, 4] + range(8, 256, 8) + range(256, max+1, 16), capped."""
    if cfg.enforce_eager:
        return []
    max_size = min(cfg.max_num_seqs * 2, 512, cfg.max_num_batched_tokens)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def weight_bytes(cfg: ServeConfig) -> float:
    """Weight bytes on one GPU: body at the quantized width, embeddings/LM head at 16 bits, split by TP."""
    m = cfg.model
    body = m.body_params * cfg.weight_bits / 8
    embed = m.embedding_params * (4 if cfg.weight_bits == 32 else 2)
    return (body + embed) / cfg.tensor_parallel_size


def activation_bytes(cfg: ServeConfig, num_tokens: int, num_seqs: int) -> float:
    """Peak activation of a forward pass over `num_tokens` tokens that samples `num_seqs` sequences.

    Per token: gate/up output (2I) + SiLU-mul output (I) in 16-bit = 6I bytes, plus ~6 hidden-size
    buffers (residual, norm, qkv, attention out) = 12H bytes; per sampled sequence fp32 logits and
    probabilities (8V bytes).
    """
    m = cfg.model
    tp = cfg.tensor_parallel_size
    per_token = (6 * m.intermediate_size / tp) + 12 * m.hidden_size
    per_seq = 8 * m.vocab_size / tp
    return num_tokens * per_token + num_seqs * per_seq


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    total_gib: float
    requested_gib: float
    weights_gib: float
    activation_gib: float
    non_torch_gib: float
    cudagraph_gib: float
    kv_cache_gib: float
    kv_bytes_per_token: int
    block_size: int
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_model_len: int
    max_concurrency_at_max_len: float
    fb_used_mib: int
    runtime_oom_tokens: int | None
    """Smallest scheduled-token count per step that runs out of memory at runtime; None = never."""

    @property
    def runtime_oom_risk(self) -> bool:
        return self.runtime_oom_tokens is not None

    def log_lines(self) -> list[str]:
        """The startup lines vLLM logs about memory and the KV cache."""
        return [
            f"Model loading took {self.weights_gib:.4f} GiB",
            f"Available KV cache memory: {self.kv_cache_gib:.2f} GiB",
            f"GPU KV cache size: {self.kv_cache_tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency_at_max_len:.2f}x",
        ]

    def runtime_oom_message(self, num_tokens: int) -> str:
        free_mib = max(0.0, (self.total_gib * GIB - self.fb_used_mib * MIB) / MIB)
        tried = max(free_mib + 2.0, 20.0)
        return (f"CUDA out of memory. Tried to allocate {tried:.2f} MiB. GPU 0 has a total capacity of "
                f"{self.total_gib:.2f} GiB of which {free_mib:.2f} MiB is free. Including non-PyTorch memory, "
                f"this process has {self.fb_used_mib / 1024:.2f} GiB memory in use. "
                f"(step of {num_tokens} tokens; gpu_memory_utilization leaves too little headroom)")


def check_config(cfg: ServeConfig) -> None:
    """vLLM's config validation at startup (SchedulerConfig / ModelConfig / ParallelConfig)."""
    m = cfg.model
    if cfg.max_model_len > m.max_model_len:
        raise StartupFailure(
            f"User-specified max_model_len ({cfg.max_model_len}) is greater than the derived max_model_len "
            # derived_max_model_len is a float for RoPE models (x the RoPE scaling factor): "4096.0"
            f"(max_position_embeddings={float(m.max_model_len)} or model_max_length=None in model's config.json). "
            "To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative position "
            "encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses absolute "
            "position encoding, positions exceeding derived_max_model_len will cause a CUDA array out-of-bounds "
            "error.")
    if cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise StartupFailure(
            f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be greater than or equal to "
            f"max_num_seqs ({cfg.max_num_seqs}).")
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
        raise StartupFailure(
            f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) is smaller than max_model_len "
            f"({cfg.max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len.")
    if m.num_heads % cfg.tensor_parallel_size:
        raise StartupFailure(
            f"Total number of attention heads ({m.num_heads}) must be divisible by tensor parallel size "
            f"({cfg.tensor_parallel_size}).")
    if cfg.block_size not in (8, 16, 32, 64, 128):
        raise StartupFailure(f"Invalid block_size {cfg.block_size}: must be one of 8, 16, 32, 64, 128.")


def kv_blocks(cfg: ServeConfig, kv_bytes: float) -> int:
    """KV-cache blocks that fit in `kv_bytes`; vLLM's refusal when one max-length request would not fit."""
    block_bytes = cfg.kv_bytes_per_token * cfg.block_size
    num_blocks = int(kv_bytes // block_bytes)
    needed = math.ceil(cfg.max_model_len / cfg.block_size) * block_bytes
    if needed > kv_bytes:
        estimated = min(cfg.max_model_len - 1, num_blocks * cfg.block_size)
        estimate_msg = (f"Based on the available memory, the estimated maximum model length is {estimated}. "
                        if estimated > 0 else "")
        raise StartupFailure(
            f"To serve at least one request with the model's max seq len ({cfg.max_model_len}), "
            f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({format_gib(kv_bytes)} GiB). {estimate_msg}Try increasing `gpu_memory_utilization` (which also "
            "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
            f"See {DOCS_URL} for more details.")
    return num_blocks


def plan_memory(cfg: ServeConfig, params: TwinParams | None = None) -> MemoryPlan:
    """The memory plan vLLM would arrive at for `cfg`, or StartupFailure with vLLM's message.

    `params` (a deployment's fitted or hidden figures) shifts the memory outside the KV pool, scales
    the activation peak and the runtime-OOM rule, or replaces the pool by a measured one."""
    params = params or NOMINAL
    check_config(cfg)
    if params.generic is not None:
        return _plan_generic(cfg, params)
    if cfg.gpu.is_cpu:
        return _plan_cpu_memory(cfg)
    total = cfg.gpu.memory_gib * GIB
    requested = total * cfg.gpu_memory_utilization
    free_at_start = total - CUDA_CONTEXT_GIB * GIB
    if free_at_start < requested:
        raise StartupFailure(
            f"Free memory on device cuda:0 ({format_gib(free_at_start)}/{format_gib(total)} GiB) on startup is less "
            f"than desired GPU memory utilization ({cfg.gpu_memory_utilization}, {format_gib(requested)} GiB). "
            "Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    weights = weight_bytes(cfg)
    if weights > free_at_start:
        raise StartupFailure(
            f"CUDA out of memory. Tried to allocate {min(weights, 2 * GIB) / MIB:.2f} MiB. GPU 0 has a total "
            f"capacity of {total / GIB:.2f} GiB of which {0.0:.2f} MiB is free. (while loading model weights of "
            f"{weights / GIB:.2f} GiB)", exc_type="torch.OutOfMemoryError")
    activation = activation_bytes(cfg, cfg.max_num_batched_tokens, cfg.max_num_seqs) * params.activation_scale
    non_torch = (NON_TORCH_GIB + (NCCL_GIB if cfg.tensor_parallel_size > 1 else 0.0)
                 + params.memory_offset_gib) * GIB
    sizes = cudagraph_capture_sizes(cfg)
    cudagraph = len(sizes) * cfg.model.num_layers * CUDAGRAPH_MIB_PER_SIZE_LAYER * MIB
    available = requested - weights - activation - non_torch - cudagraph
    if available <= 0:
        raise StartupFailure(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite "
            f"its name). See {DOCS_URL} for more details.")
    kv_per_token = cfg.kv_bytes_per_token
    if params.kv_pool_tokens is not None:
        available = float(params.kv_pool_tokens * kv_per_token)
    num_blocks = kv_blocks(cfg, available)
    kv_tokens = num_blocks * cfg.block_size
    fb_used = CUDA_CONTEXT_GIB * GIB + requested
    return MemoryPlan(
        total_gib=total / GIB,
        requested_gib=requested / GIB,
        weights_gib=weights / GIB,
        activation_gib=activation / GIB,
        non_torch_gib=non_torch / GIB,
        cudagraph_gib=cudagraph / GIB,
        kv_cache_gib=available / GIB,
        kv_bytes_per_token=kv_per_token,
        block_size=cfg.block_size,
        num_gpu_blocks=num_blocks,
        kv_cache_tokens=kv_tokens,
        max_model_len=cfg.max_model_len,
        max_concurrency_at_max_len=kv_tokens / cfg.max_model_len,
        fb_used_mib=int(min(fb_used, total) / MIB),
        runtime_oom_tokens=_runtime_oom_tokens(cfg, total, fb_used, params),
    )


GENERIC_KV_POOL_TOKENS = 1 << 24
"""A generic model's pool when none was measured: large enough never to bind (its memory is unknown)."""


def _plan_generic(cfg: ServeConfig, params: TwinParams) -> MemoryPlan:
    """No architecture to size memory with: the measured pool, or one that never binds; no memory failures."""
    tokens = params.kv_pool_tokens or GENERIC_KV_POOL_TOKENS
    blocks = max(1, tokens // cfg.block_size)
    total = cfg.gpu.memory_gib * GIB
    requested = total * cfg.gpu_memory_utilization
    return MemoryPlan(
        total_gib=total / GIB, requested_gib=requested / GIB, weights_gib=0.0, activation_gib=0.0,
        non_torch_gib=0.0, cudagraph_gib=0.0, kv_cache_gib=0.0, kv_bytes_per_token=cfg.kv_bytes_per_token,
        block_size=cfg.block_size, num_gpu_blocks=blocks, kv_cache_tokens=blocks * cfg.block_size,
        max_model_len=cfg.max_model_len, max_concurrency_at_max_len=blocks * cfg.block_size / cfg.max_model_len,
        fb_used_mib=int(min(requested + CUDA_CONTEXT_GIB * GIB, total) / MIB), runtime_oom_tokens=None)


def _plan_cpu_memory(cfg: ServeConfig) -> MemoryPlan:
    """vLLM's CPU worker (`cpu_worker.py`): gmu is the share of the NUMA node's memory reserved for the worker.

      requested = ceil(node total x gpu_memory_utilization), refused when above the node's available memory
      KV pool   = requested - the worker's resident memory (runtime + weights + activation peak)
    Without VLLM_CPU_KVCACHE_SPACE (which the twin does not model); there are no CUDA graphs on CPU.
    """
    total = cfg.gpu.memory_gib * GIB
    requested = float(math.ceil(total * cfg.gpu_memory_utilization))
    available = total - CPU_STARTUP_USED_GIB * GIB
    if requested > available:
        raise StartupFailure(
            f"Available memory on node 0 ({format_gib(available)}/{format_gib(total)} GiB) on startup is less "
            f"than desired CPU memory utilization ({cfg.gpu_memory_utilization}, {format_gib(requested)} GiB). "
            "On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory reserved "
            "(despite its name). To resolve: decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization "
            "0.5`) or reduce CPU memory used by other processes.")
    weights = weight_bytes(cfg)
    activation = activation_bytes(cfg, cfg.max_num_batched_tokens, cfg.max_num_seqs)
    consumed = CPU_WORKER_BASE_GIB * GIB + weights + activation
    kv = int(requested - consumed)
    if kv <= 0 or kv > available:
        raise StartupFailure(
            f"Available memory on node 0 ({format_gib(available)}/{format_gib(total)} GiB) on kv cache allocation "
            f"is less than requested memory for kv ({format_gib(kv)}/{format_gib(requested)} GiB). "
            "Reduce CPU memory used by other processes.")
    kv_per_token = cfg.kv_bytes_per_token
    num_blocks = kv_blocks(cfg, kv)
    kv_tokens = num_blocks * cfg.block_size
    return MemoryPlan(
        total_gib=total / GIB,
        requested_gib=requested / GIB,
        weights_gib=weights / GIB,
        activation_gib=activation / GIB,
        non_torch_gib=CPU_WORKER_BASE_GIB,
        cudagraph_gib=0.0,
        kv_cache_gib=kv / GIB,
        kv_bytes_per_token=kv_per_token,
        block_size=cfg.block_size,
        num_gpu_blocks=num_blocks,
        kv_cache_tokens=kv_tokens,
        max_model_len=cfg.max_model_len,
        max_concurrency_at_max_len=kv_tokens / cfg.max_model_len,
        fb_used_mib=int(min(requested, total) / MIB),
        runtime_oom_tokens=None,  # the KV pool is host memory; no separate runtime headroom to run out of
    )


def _runtime_oom_tokens(cfg: ServeConfig, total: float, fb_used: float, params: TwinParams) -> int | None:
    """Runtime-OOM rule: a step of T tokens needs RUNTIME_FIXED + RUNTIME_FRAGMENT x activation(T) beyond
    the profiled budget; it fails when that exceeds the memory left outside the budget (total - used)."""
    headroom = total - fb_used
    fraction = params.runtime_fragment_fraction * params.activation_scale
    per_token = activation_bytes(cfg, 1, 0) * fraction
    fixed = params.runtime_fixed_gib * GIB + activation_bytes(cfg, 0, cfg.max_num_seqs) * fraction
    if fixed + per_token * cfg.max_num_batched_tokens <= headroom:
        return None
    return max(1, math.ceil((headroom - fixed) / per_token))
