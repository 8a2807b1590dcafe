"""Value types shared by the tuning benchmark: knobs, loads, SLOs, readings and the strategy protocol."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from batchtune.core.burst import Burst

LoadKind = Literal["concurrency", "request_rate"]
ObjectiveKind = Literal["capacity", "throughput"]


@dataclass(frozen=True, order=True)
class Knobs:
    """One vLLM batching setting as the benchmark sees it (integer percent, as in the CRD)."""

    max_num_seqs: int
    gpu_memory_utilization_pct: int
    max_num_batched_tokens: int | None = None
    """None means vLLM's default for the GPU."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 1 <= self.gpu_memory_utilization_pct <= 100:
            raise ValueError(f"gpu_memory_utilization_pct must be in 1..100, got {self.gpu_memory_utilization_pct}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    @property
    def gpu_memory_utilization(self) -> float:
        return self.gpu_memory_utilization_pct / 100.0

    def label(self) -> str:
        mbt = "" if self.max_num_batched_tokens is None else f"/mbt{self.max_num_batched_tokens}"
        return f"mns{self.max_num_seqs}/gmu{self.gpu_memory_utilization_pct}{mbt}"


@dataclass(frozen=True)
class Load:
    """Offered load of one load step: closed-loop concurrency or open-loop Poisson request rate."""

    kind: LoadKind
    value: float

    def __post_init__(self) -> None:
        if not self.value > 0:
            raise ValueError(f"load value must be > 0, got {self.value} ({self.kind})")

    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"rate={self.value:.2f}/s"


@dataclass(frozen=True)
class Slo:
    """Upper limits on `vllm bench serve` result keys (e.g. `p95_ttft_ms`). All must hold."""

    limits: Mapping[str, float]

    def __post_init__(self) -> None:
        if not self.limits:
            raise ValueError("an SLO needs at least one limit")
        for key, limit in self.limits.items():
            if not key.endswith("_ms") or not limit > 0:
                raise ValueError(f"SLO limit {key}={limit!r}: keys are '*_ms' result keys with a positive limit")

    def met_by(self, metrics: Mapping[str, float] | None) -> bool:
        """Missing or NaN metrics never pass."""
        if not metrics:
            return False
        for key, limit in self.limits.items():
            value = metrics.get(key)
            if value is None or not isinstance(value, (int, float)) or math.isnan(value) or value > limit:
                return False
        return True

    def margin(self, metrics: Mapping[str, float] | None) -> float:
        """Worst ratio metric/limit; <= 1 passes. inf when a metric is missing."""
        if not metrics:
            return math.inf
        worst = 0.0
        for key, limit in self.limits.items():
            value = metrics.get(key)
            if value is None or math.isnan(value):
                return math.inf
            worst = max(worst, value / limit)
        return worst

    def label(self) -> str:
        return ", ".join(f"{k.removesuffix('_ms')}<={v:g}ms" for k, v in self.limits.items())


@dataclass(frozen=True)
class Reading:
    """What one load step returned: `vllm bench serve` style metrics, or the failure that ended it."""

    load: Load
    metrics: Mapping[str, float] = field(default_factory=dict)
    failure: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None

    def get(self, key: str, default: float = math.nan) -> float:
        return float(self.metrics.get(key, default))


@dataclass(frozen=True)
class StartResult:
    ok: bool
    seconds: float
    error: str | None = None


class Testbed(Protocol):
    """What a tuning strategy may do on the benchmark's simulated GPU: start servers and offer load.

    Every call is charged to the strategy's ledger (trials and GPU time).
    """

    @property
    def running(self) -> Knobs | None:
        """The setting the server runs now; None when none is up (not started, or it failed)."""
        ...

    def start(self, knobs: Knobs) -> StartResult: ...

    def run_load(self, load: Load, *, prompts: int | None = None, warmup: bool = False,
                 seconds: float | None = None) -> Reading:
        """`seconds`: the measured window when it is not the scenario's (a bracketing step's, a lengthened run's)."""
        ...

    def run_burst(self, burst: Burst) -> Reading:
        """A full token-budget burst on the running server (`core.burst`): its reading, or the failure it caused."""
        ...


@dataclass(frozen=True)
class Choice:
    """A strategy's answer: the setting it recommends and the load it claims that setting holds."""

    knobs: Knobs | None
    claimed_load: Load | None = None
    note: str = ""
    predictions: tuple[Mapping[str, object], ...] = ()
    """A twin-guided strategy's trials: what its twin predicted for each, against what the trial measured."""
