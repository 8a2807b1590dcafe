"""Continuous tuning's decisions (pure): when a round starts, whether its best wins (controller/retune.py runs them).

After a decision a BatchTuning with `spec.retune` keeps watching production. A new round starts when
the schedule fires (`intervalSeconds` after the last round ended) or when production's workload
drifted past a threshold from the profile the last decision was made for (`core.workload.drift`).
A round measures production's own setting as its trial 0, beside the candidates, under the same
load; its best candidate replaces (Auto) or is recommended over production's setting only when it
beats it by `minImprovementPercent` on the objective, as NVIDIA Dynamo's planner keeps the current
configuration unless a candidate wins by a margin. Rounds never overlap: one starts only from a
decided state, and the start is one status write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from batchtune.core.vocabulary import Reason
from batchtune.core.workload import DriftThresholds, beats_by_margin, improvement_percent

MAX_ROUNDS_IN_STATUS = 10
"""Rounds kept in status (oldest dropped first); the report ConfigMap has the latest round's trials in full."""


class Trigger(StrEnum):
    """Why a round started."""

    INITIAL = "Initial"
    SCHEDULE = "Schedule"
    DRIFT = "Drift"


@dataclass(frozen=True)
class RetunePolicy:
    interval_seconds: int | None = None
    thresholds: DriftThresholds | None = None
    check_interval_seconds: int = 300
    min_improvement_percent: int = 5

    @property
    def watches_drift(self) -> bool:
        return self.thresholds is not None

    def schedule_due(self, last_ended: datetime | None, now: datetime) -> str | None:
        """Why the schedule starts a round now, or None."""
        if self.interval_seconds is None or last_ended is None:
            return None
        due = last_ended + timedelta(seconds=self.interval_seconds)
        if now < due:
            return None
        return (f"spec.retune.intervalSeconds: {self.interval_seconds}s have passed since the last round ended at "
                f"{last_ended.strftime('%Y-%m-%dT%H:%M:%SZ')}")

    def next_check(self, last_ended: datetime | None, now: datetime) -> datetime:
        """When the watch looks again: every check interval with drift thresholds, else when the schedule is due."""
        step = now + timedelta(seconds=self.check_interval_seconds)
        if self.watches_drift or self.interval_seconds is None or last_ended is None:
            return step
        return max(now + timedelta(seconds=1), last_ended + timedelta(seconds=self.interval_seconds))


@dataclass(frozen=True)
class RoundVerdict:
    """Whether a round's best candidate replaces production's setting."""

    change: bool
    reason: Reason | None
    """KeptCurrent or AlreadyOptimal when production keeps its setting; None for a change."""
    improvement_percent: float | None
    """The candidate's gain over production's setting (None: production's missed the SLO, or no candidate)."""
    message: str


def judge_round(objective_words: str, best_label: str | None, best_value: float | None, current_label: str,
                current_value: float | None, same_command_line: bool, margin_percent: int) -> RoundVerdict:
    """Change production (or recommend a change) only for a candidate that beats its setting by the margin.

    `current_value` is None when production's own setting missed the SLO (or could not be measured)
    under the round's load: then any candidate that met it wins.
    """
    if best_label is None or best_value is None:
        why = ("production's setting is kept" if current_value is not None else
               "production's setting is kept, though it missed the SLO too")
        return RoundVerdict(False, Reason.KEPT_CURRENT, None,
                            f"no other setting met the SLO under this round's workload: {why} ({current_label})")
    if same_command_line:
        return RoundVerdict(False, Reason.ALREADY_OPTIMAL, 0.0 if current_value is not None else None,
                            f"production already runs the best setting ({best_label})")
    gain = improvement_percent(best_value, current_value)
    if current_value is None:
        return RoundVerdict(True, None, None,
                            f"production's setting ({current_label}) missed the SLO under this round's workload; "
                            f"{best_label} met it with {objective_words} {best_value:.4g}")
    assert gain is not None
    if beats_by_margin(best_value, current_value, margin_percent):
        return RoundVerdict(True, None, gain,
                            f"{best_label} beats production's {current_label} by {gain:.1f}% on {objective_words} "
                            f"({best_value:.4g} vs {current_value:.4g}; spec.retune.minImprovementPercent "
                            f"{margin_percent}%)")
    word = "by only" if gain > 0 else "by"
    return RoundVerdict(False, Reason.KEPT_CURRENT, gain,
                        f"the best other setting, {best_label}, beats production's {current_label} {word} "
                        f"{gain:.1f}% on {objective_words} ({best_value:.4g} vs {current_value:.4g}), below "
                        f"spec.retune.minImprovementPercent {margin_percent}%: production keeps its setting")


def finite(value: float | None) -> float | None:
    """A figure status can hold (JSON has no infinity)."""
    return value if value is not None and math.isfinite(value) else None
