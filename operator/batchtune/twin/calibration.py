"""Public reference measurements the twin is calibrated against (docs/twin.md, vllm-gpu-facts.md §5).

Each point names the setting, the load as it was run, the measured values and the tolerance the
calibration test holds the model to. Shared by the tests, the docs plot and hack/bench-twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchtune.twin.config import ServeConfig
from batchtune.twin.predict import Prediction, Workload, predict


@dataclass(frozen=True)
class ReferencePoint:
    case: str
    """Reference id in vllm-gpu-facts.md (R3, R4, R6, R11)."""
    label: str
    cfg: ServeConfig
    workload: Workload
    measured: dict[str, float]
    """`vllm bench serve` key -> measured value."""
    tolerance: dict[str, float] = field(default_factory=dict)
    """key -> allowed relative error (0.2 = 20%); keys without one are shown, not asserted."""
    duration_s: float = 60.0


def _cfg(model: str, gpu: str, gpu_memory_utilization: float = 0.9, max_model_len: int | None = None) -> ServeConfig:
    return ServeConfig(model=model, gpu=gpu, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len)


def reference_points() -> list[ReferencePoint]:
    points: list[ReferencePoint] = []
    # R3: Llama-3.1-8B bf16 on A100 40GB, vLLM 0.23 defaults, random 1024/128, closed loop.
    a100 = _cfg("meta-llama/Llama-3.1-8B-Instruct", "A100-40GB")
    points.append(ReferencePoint("R3", "A100-40GB Llama-3.1-8B c=1", a100, Workload(1024, 128, concurrency=1),
                                 {"output_throughput": 75.0}, {"output_throughput": 0.15}))
    points.append(ReferencePoint("R3", "A100-40GB Llama-3.1-8B c=8", a100, Workload(1024, 128, concurrency=8),
                                 {"output_throughput": 75.0 * 6.6}, {"output_throughput": 0.20}))
    # R4: Qwen2.5-7B on RTX A6000, vLLM 0.23 defaults (max_num_seqs 256), ~51 output tokens, short chat
    # prompts (assumed 24 tokens: the report does not give them; TPOT at c=256 bounds them to < ~40).
    a6000 = _cfg("Qwen/Qwen2.5-7B-Instruct", "NVIDIA-RTX-A6000")
    r4 = [(1, 12, 21.9, 42.3), (2, 12, 22.0, 84.0), (4, 12, 22.1, 153.1), (8, 12, 22.3, 240.4),
          (64, 512, 27.5, 2127.6), (128, 512, 36.0, 3138.1), (256, 512, 53.1, 4039.9), (512, 512, 56.4, 3896.1)]
    for conc, n, tpot, toks in r4:
        points.append(ReferencePoint(
            "R4", f"A6000 Qwen2.5-7B c={conc}", a6000, Workload(24, 51, concurrency=conc, num_prompts=n, output_dist="uniform", range_ratio=0.2),
            {"median_tpot_ms": tpot, "output_throughput": toks},
            {"median_tpot_ms": 0.25, "output_throughput": 0.25}, duration_s=600))
    # R6: Mistral-7B on RTX 4090, 256 in, 300 prompts, rate inf with max concurrency; without
    # --ignore-eos the outputs averaged ~100 tokens (out tok/s / req/s), so output_len=100.
    r4090 = _cfg("mistralai/Mistral-7B-Instruct-v0.3", "NVIDIA-GeForce-RTX-4090")
    r6 = [(4, 2.09, 210, 63, 53), (8, 3.78, 377, 79, 55), (16, 6.44, 644, 155, 97), (32, 9.73, 975, 362, 277),
          (48, 11.87, 1190, 667, 840)]
    for conc, rps, toks, mean_ttft, _median_ttft in r6:
        points.append(ReferencePoint(
            "R6", f"RTX-4090 Mistral-7B c={conc}", r4090, Workload(256, 100, concurrency=conc, num_prompts=300, output_dist="uniform", range_ratio=0.28),
            {"request_throughput": rps, "output_throughput": toks, "mean_ttft_ms": mean_ttft},
            {"request_throughput": 0.25, "output_throughput": 0.25}, duration_s=600))
    # R11: Qwen3-0.6B on H100, gmu 0.5, max_model_len 2048, random 512/128, 500 prompts.
    h100 = _cfg("Qwen/Qwen3-0.6B", "NVIDIA-H100-80GB-HBM3", gpu_memory_utilization=0.5, max_model_len=2048)
    points.append(ReferencePoint(
        "R11", "H100 Qwen3-0.6B rate=16", h100, Workload(512, 128, request_rate=16.0, num_prompts=500),
        {"request_throughput": 15.87, "mean_ttft_ms": 38.9, "mean_tpot_ms": 2.39},
        {"request_throughput": 0.10, "mean_ttft_ms": 0.5, "mean_tpot_ms": 0.25}, duration_s=600))
    points.append(ReferencePoint(
        "R11", "H100 Qwen3-0.6B rate=inf", h100, Workload(512, 128, request_rate=math.inf, num_prompts=500),
        {"request_throughput": 94.91, "mean_ttft_ms": 2905.0, "mean_tpot_ms": 5.45},
        {"request_throughput": 0.25}, duration_s=600))
    return points


@dataclass(frozen=True)
class Residual:
    point: ReferencePoint
    key: str
    measured: float
    predicted: float | None

    @property
    def rel_error(self) -> float:
        if self.predicted is None:
            return math.inf
        return (self.predicted - self.measured) / self.measured

    @property
    def tolerance(self) -> float | None:
        return self.point.tolerance.get(self.key)

    @property
    def within(self) -> bool:
        tol = self.tolerance
        return tol is None or abs(self.rel_error) <= tol


def evaluate(points: list[ReferencePoint] | None = None) -> list[Residual]:
    out: list[Residual] = []
    for point in points or reference_points():
        pred: Prediction = predict(point.cfg, point.workload, point.duration_s, seed=0)
        for key, value in point.measured.items():
            out.append(Residual(point, key, value, pred.get(key)))
    return out


def format_residuals(residuals: list[Residual]) -> str:
    lines = [f"{'reference':34s} {'metric':20s} {'measured':>10s} {'model':>10s} {'error':>8s} {'tol':>6s}"]
    for r in residuals:
        tol = f"{r.tolerance:.0%}" if r.tolerance is not None else "-"
        pred = f"{r.predicted:10.2f}" if r.predicted is not None else f"{'-':>10s}"
        flag = "" if r.within else "  OUT"
        lines.append(f"{r.point.label:34s} {r.key:20s} {r.measured:10.2f} {pred} {r.rel_error:+8.1%} {tol:>6s}{flag}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_residuals(evaluate()))
