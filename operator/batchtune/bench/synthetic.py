"""A small closed-form stand-in for the twin, for unit tests and for developing strategies fast.

Not physical: decode step time grows linearly with the running batch, the KV pool grows with gpu
memory utilization, large batches past the KV pool preempt, and gmu >= `oom_gmu_pct` with a token
budget >= `oom_tokens` runs out of memory at runtime. Open-loop queueing follows M/M/1.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from batchtune.bench.types import Knobs, Load, Reading, StartResult


@dataclass(frozen=True)
class SyntheticTruth:
    memory_gib: float = 80.0
    weights_gib: float = 16.0
    kv_kib_per_token: float = 128.0
    step_base_ms: float = 8.0
    step_per_seq_ms: float = 0.06
    prefill_ms_per_token: float = 0.08
    oom_gmu_pct: int = 97
    oom_tokens: int = 16384
    startup_s: float = 90.0

    def kv_tokens(self, knobs: Knobs) -> float:
        budget = self.memory_gib * knobs.gpu_memory_utilization - self.weights_gib - 2.0
        return max(0.0, budget) * 1024 * 1024 / self.kv_kib_per_token

    def startup(self, scenario: object, knobs: Knobs) -> StartResult:
        need = getattr(scenario, "input_len", 512) + getattr(scenario, "output_len", 256)
        if self.kv_tokens(knobs) < need:
            return StartResult(False, 40.0, "No available memory for the cache blocks.")
        return StartResult(True, self.startup_s)

    def measure(
        self, scenario: object, knobs: Knobs, load: Load, *, duration_s: float, seed: int, noise: float,
        prompts: int | None = None, warmup_s: float | None = None,
    ) -> Reading:
        if load.kind == "request_rate" and math.isinf(load.value):
            load = Load("concurrency", float(prompts or 1000))  # everything at once: a full closed loop
        mbt = knobs.max_num_batched_tokens or 8192
        if knobs.gpu_memory_utilization_pct >= self.oom_gmu_pct and mbt >= self.oom_tokens:
            return Reading(load, failure="torch.OutOfMemoryError: CUDA out of memory.")
        in_len = getattr(scenario, "input_len", 512)
        out_len = getattr(scenario, "output_len", 256)
        ctx = in_len + out_len / 2
        kv_seqs = self.kv_tokens(knobs) / ctx
        cap = min(knobs.max_num_seqs, kv_seqs)
        preempt = max(0.0, knobs.max_num_seqs - kv_seqs)

        def serve(batch: float) -> tuple[float, float]:
            step_ms = self.step_base_ms + self.step_per_seq_ms * batch + 0.02 * preempt
            e2e_ms = in_len * self.prefill_ms_per_token + out_len * step_ms
            return step_ms, batch / (e2e_ms / 1000.0)

        step_full, max_rps = serve(cap)
        if load.kind == "concurrency":
            batch = min(load.value, cap)
            step_ms, rps = serve(batch)
            queue_ms = max(0.0, load.value - cap) / max(rps, 1e-9) * 1000.0
        else:
            rho = load.value / max_rps
            if rho >= 1.0:
                step_ms, rps = step_full, max_rps
                queue_ms = duration_s * 1000.0 * (rho - 1.0) / rho + 1000.0
            else:
                batch = min(cap, load.value * (in_len * self.prefill_ms_per_token + out_len * step_full) / 1000.0)
                step_ms, _ = serve(batch)
                rps = load.value
                queue_ms = step_ms * rho / (1.0 - rho)
        ttft = in_len * self.prefill_ms_per_token + queue_ms
        e2e = ttft + out_len * step_ms
        rng = random.Random(seed)

        def jitter(x: float) -> float:
            return x * max(0.1, 1.0 + noise * rng.gauss(0.0, 1.0)) if noise > 0 else x

        metrics = {
            "request_throughput": jitter(rps),
            "output_throughput": jitter(rps * out_len),
            "p95_ttft_ms": jitter(ttft * 1.3),
            "p99_ttft_ms": jitter(ttft * 1.6),
            "p95_itl_ms": jitter(step_ms * 1.2),
            "p99_itl_ms": jitter(step_ms * 1.4),
            "p99_e2el_ms": jitter(e2e * 1.2),
            "mean_e2el_ms": jitter(e2e),
            "kv_cache_usage_pct": min(100.0, 100.0 * cap * ctx / max(self.kv_tokens(knobs), 1.0)),
            "preemptions_per_s": preempt * 0.1 if load.kind == "concurrency" and load.value > kv_seqs else 0.0,
        }
        if any(math.isnan(v) for v in metrics.values()):
            return Reading(load, failure="nan")
        return Reading(load, metrics)
