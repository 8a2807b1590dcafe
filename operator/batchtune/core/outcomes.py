"""What a finished trial tells the search: its state, SLO verdict and objective value."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from batchtune.core.settings import Setting
from batchtune.core.vocabulary import FINISHED_TRIAL_STATES, MEMORY_REASONS, Reason, TrialState, Verdict

__all__ = ["MEMORY_REASONS", "History", "HistoryEntry", "Reason", "StepObservation", "TrialOutcome", "TrialState",
           "Verdict"]


@dataclass(frozen=True)
class StepObservation:
    """One closed load step of a trial: what a calibration learns from."""

    load: int
    """Concurrent requests, or requests per minute (open loop)."""
    metrics: Mapping[str, float]
    verdict: Verdict = Verdict.UNKNOWN
    margin: float | None = None
    """Worst relative SLO margin (negative: exceeded)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))
        object.__setattr__(self, "verdict", Verdict(self.verdict))


@dataclass(frozen=True)
class TrialOutcome:
    state: TrialState
    """Done, Infeasible or Failed: strategies never see a running trial as an outcome."""
    verdict: Verdict = Verdict.UNKNOWN
    objective: float | None = None
    """Objective value (higher is better); None when not measured."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Status metric names (camelCase: outputThroughput, ttftMs, kvCacheUsagePercent, ...)."""
    reason: str = ""
    """A `Reason` (for Infeasible: the memory reasons the strategies prune on, when known)."""
    message: str = ""
    steps: tuple[StepObservation, ...] = ()
    """The trial's load steps in order (empty when it never ran load)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", TrialState(self.state))
        object.__setattr__(self, "steps", tuple(self.steps))
        if self.state not in FINISHED_TRIAL_STATES:
            raise ValueError(f"a trial outcome is Done, Infeasible or Failed, not {self.state.value}")
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
