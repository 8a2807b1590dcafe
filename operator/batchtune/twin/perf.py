"""Step-time model: how long one vLLM engine step takes on a GPU, and the GPU signals it produces.

A step reads the weights once and the KV cache of every scheduled token, and does 2 FLOPs per
parameter per token plus attention. The roofline gives a memory time and a compute time; real
kernels do not overlap them perfectly, so they are combined with a p-norm (p = 2 sits between a
sum, p = 1, and the ideal max, p = inf), together with a kernel-latency floor per layer that
dominates for tiny models. CPU work (scheduler, sampler, output processing) adds a fixed part and a
part per scheduled sequence. Constants are calibrated in tests/unit/test_twin_calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batchtune.twin.config import ServeConfig
from batchtune.twin.params import (
    LAYER_FLOOR_S,
    NOMINAL,
    SEQ_OVERHEAD_S,
    STEP_OVERHEAD_S,
    TwinParams,
)

P_NORM = 2.0
"""Exponent combining memory time, compute time and the kernel floor."""
LAYER_FLOOR_EAGER_S = 140e-6
"""Per-layer floor without CUDA graphs (kernel launches dominate tiny steps)."""
ALLREDUCE_LATENCY_S = 12e-6
"""Fixed latency of one tensor-parallel all-reduce; two per layer."""


class StepCost(Protocol):
    """What the engine asks of a step-time model: the roofline (`StepCostModel`) or a fitted generic one."""

    def step_time(self, num_tokens: float, num_seqs: float, kv_tokens_read: float, attn_qk: float,
                  prompt_tokens: float = 0) -> tuple[float, float, float, float]: ...

    def signals(self, duration: float, t_gpu: float, nbytes: float, flops: float) -> tuple[
            float, float, float, float, float]: ...


def nominal_params() -> TwinParams:
    """The catalog's parameters."""
    return NOMINAL


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Per-config constants, precomputed so the per-step cost is a handful of float operations."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    lm_head_flops_per_seq: float
    attn_flops_per_qk: float
    bytes_per_s: float
    flops_per_s: float
    peak_bytes_per_s: float
    peak_flops_per_s: float
    floor_graph_s: float
    floor_eager_s: float
    max_graph_tokens: int
    tp_bytes_per_token: float
    tp_fixed_s: float
    interconnect_bytes_per_s: float
    idle_w: float
    tdp_w: float
    step_overhead_s: float = STEP_OVERHEAD_S
    seq_overhead_s: float = SEQ_OVERHEAD_S
    kv_bytes_per_s: float = 0.0
    """Bandwidth of KV-cache reads; 0: the same as the weights' (`bytes_per_s`)."""
    prefill_token_s: float = 0.0
    """CPU time per scheduled prompt token (a deployment's own input preparation)."""

    @classmethod
    def for_config(cls, cfg: ServeConfig, weight_bytes: float, max_graph_tokens: int,
                   params: TwinParams | None = None) -> StepCostModel:
        m, gpu, tp = cfg.model, cfg.gpu, cfg.tensor_parallel_size
        peak_flops = gpu.peak_tflops(cfg.fp8_compute) * 1e12
        embed_rows = m.vocab_size * m.hidden_size * (0 if m.tied_embeddings else 1) / tp
        params = params or nominal_params()
        bw = gpu.bandwidth_gbps * 1e9 * gpu.eta_bw * params.bw_scale
        return cls(
            # the input-embedding table is gathered, not streamed; everything else is read every step
            weight_bytes=weight_bytes - embed_rows * 2,
            kv_bytes_per_token=float(cfg.kv_bytes_per_token),
            flops_per_token=2 * m.body_params / tp,
            lm_head_flops_per_seq=2 * m.lm_head_params / tp,
            attn_flops_per_qk=4 * m.num_layers * (m.num_heads // tp) * m.head_dim,
            bytes_per_s=bw,
            flops_per_s=peak_flops * gpu.eta_flops * params.flops_scale,
            peak_bytes_per_s=gpu.bandwidth_gbps * 1e9,
            peak_flops_per_s=peak_flops,
            floor_graph_s=m.num_layers * params.layer_floor_s,
            floor_eager_s=m.num_layers * LAYER_FLOOR_EAGER_S * (params.layer_floor_s / LAYER_FLOOR_S),
            max_graph_tokens=0 if cfg.enforce_eager else max_graph_tokens,
            tp_bytes_per_token=(m.hidden_size * 2 * 2 * (tp - 1) / tp) * 2 * m.num_layers if tp > 1 else 0.0,
            tp_fixed_s=2 * m.num_layers * ALLREDUCE_LATENCY_S if tp > 1 else 0.0,
            interconnect_bytes_per_s=gpu.interconnect_gbps * 1e9,
            idle_w=gpu.idle_w,
            tdp_w=gpu.tdp_w,
            step_overhead_s=params.step_overhead_s,
            seq_overhead_s=params.seq_overhead_s,
            kv_bytes_per_s=0.0 if params.kv_read_efficiency == 1.0 else bw * params.kv_read_efficiency,
            prefill_token_s=params.prefill_token_overhead_s,
        )

    def step_time(self, num_tokens: float, num_seqs: float, kv_tokens_read: float, attn_qk: float,
                  prompt_tokens: float = 0) -> tuple[float, float, float, float]:
        """(duration_s, gpu_busy_s, bytes moved, flops) of one step."""
        kv_bytes = kv_tokens_read * self.kv_bytes_per_token
        nbytes = self.weight_bytes + kv_bytes
        flops = self.flops_per_token * num_tokens + self.lm_head_flops_per_seq * num_seqs + \
            self.attn_flops_per_qk * attn_qk
        if self.kv_bytes_per_s:
            t_mem = self.weight_bytes / self.bytes_per_s + kv_bytes / self.kv_bytes_per_s
        else:
            t_mem = nbytes / self.bytes_per_s
        t_cmp = flops / self.flops_per_s
        t_floor = self.floor_graph_s if num_tokens <= self.max_graph_tokens else self.floor_eager_s
        p = P_NORM
        t_gpu = (t_mem ** p + t_cmp ** p + t_floor ** p) ** (1.0 / p)
        if self.tp_fixed_s:
            t_gpu += self.tp_fixed_s + num_tokens * self.tp_bytes_per_token / self.interconnect_bytes_per_s
        duration = t_gpu + self.step_overhead_s + self.seq_overhead_s * num_seqs
        if self.prefill_token_s:
            duration += self.prefill_token_s * prompt_tokens
        return duration, t_gpu, nbytes, flops

    def signals(self, duration: float, t_gpu: float, nbytes: float, flops: float) -> tuple[
            float, float, float, float, float]:
        """(sm_active, sm_occupancy, tensor_active, dram_active, power_w) averaged over one step."""
        busy = t_gpu / duration
        dram = min(0.92, nbytes / (self.peak_bytes_per_s * t_gpu)) * busy
        tensor = min(0.95, flops / (self.peak_flops_per_s * t_gpu)) * busy
        compute_share = tensor / (tensor + dram) if tensor + dram > 0 else 0.0
        sm_active = min(0.99, busy * (0.55 + 0.4 * compute_share))
        sm_occupancy = sm_active * (0.2 + 0.35 * compute_share)
        power = self.idle_w + (self.tdp_w - self.idle_w) * min(1.0, 0.15 * busy + 0.45 * dram + 0.7 * tensor)
        return sm_active, sm_occupancy, tensor, dram, power
