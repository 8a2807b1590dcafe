"""What a finished trial tells the search: its state, SLO verdict and objective value."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Mapping, Sequence

from batchtune.core.settings import Setting


class TrialState(StrEnum):
    """Terminal states only: strategies never see a running trial as an outcome."""

    DONE = "Done"
    INFEASIBLE = "Infeasible"  # the setting cannot work (memory): informs pruning
    FAILED = "Failed"  # something else went wrong (timeout, crash): tells nothing about the setting


class Verdict(StrEnum):
    MET = "Met"
    VIOLATED = "Violated"
    UNKNOWN = "Unknown"


# Reasons the operator's failure classifier puts on Infeasible outcomes; the strategies prune on them.
REASON_GPU_MEMORY_UTILIZATION_TOO_HIGH = "GpuMemoryUtilizationTooHigh"
"""vLLM: "Free memory on device ... is less than desired GPU memory utilization": any higher gmu fails too."""
REASON_KV_CACHE_TOO_SMALL = "KvCacheTooSmall"
"""vLLM: "No available memory for the cache blocks" / "KV cache is needed, which is larger than the available"."""
REASON_OUT_OF_MEMORY = "OutOfMemory"
"""CUDA out of memory at runtime, or the container OOMKilled: more seqs/tokens needs more, lower gmu leaves less."""

MEMORY_REASONS = frozenset({REASON_KV_CACHE_TOO_SMALL, REASON_OUT_OF_MEMORY})


@dataclass(frozen=True)
class TrialOutcome:
    state: TrialState
    verdict: Verdict = Verdict.UNKNOWN
    objective: float | None = None
    """Objective value (higher is better); None when not measured."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Status metric names (camelCase: outputThroughput, ttftMs, kvCacheUsagePercent, ...)."""
    reason: str = ""
    """UpperCamelCase reason (for Infeasible: one of the REASON_* constants when known)."""
    message: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", TrialState(self.state))
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))
        if self.objective is not None and not math.isfinite(self.objective):
            object.__setattr__(self, "objective", None)  # NaN/inf never ranks

    @property
    def met(self) -> bool:
        return self.state is TrialState.DONE and self.verdict is Verdict.MET

    def metric(self, name: str) -> float | None:
        """A finite metric value or None."""
        value = self.metrics.get(name)
        if value is None:
            return None
        try:
            value = float(value)
        except (TypeError, ValueError):
            return None
        return value if math.isfinite(value) else None


HistoryEntry = tuple[Setting, TrialOutcome]
History = Sequence[HistoryEntry]
