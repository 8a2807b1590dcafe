"""The ask/tell shape every strategy shares; the next ask is a pure function of the history."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection

from batchtune.core.objective import Objective
from batchtune.core.outcomes import History, HistoryEntry, TrialOutcome
from batchtune.core.planning import Plan, PrunedSetting
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets


class Strategy(ABC):
    """`ask(history, pending)` -> the next setting, or None.

    None with trials still pending means "wait for them"; None with nothing pending means the
    search is over. History holds finished trials in trial order; a strategy rebuilt from the same
    plan, seed and history asks the same next setting (state lives in the BatchTuning status).
    """

    kind: str = ""

    def __init__(
        self,
        plan: Plan,
        slo: SloTargets,
        objective: Objective | str = Objective.SLO_CAPACITY,
        seed: int = 0,
        max_trials: int = 12,
    ) -> None:
        if max_trials < 1:
            raise ValueError(f"maxTrials {max_trials!r} must be >= 1")
        self.plan = plan
        self.slo = slo
        self.objective = Objective(objective)
        self.seed = seed
        self.max_trials = max_trials
        self._told: list[HistoryEntry] = []

    def tell(self, setting: Setting, outcome: TrialOutcome) -> None:
        """Record a finished trial for callers that do not keep the history themselves."""
        self._told.append((setting, outcome))

    @property
    def history(self) -> list[HistoryEntry]:
        return list(self._told)

    def ask(self, history: History | None = None, pending: Collection[Setting] = ()) -> Setting | None:
        entries = list(self._told if history is None else history)
        if len(entries) + len(pending) >= self.max_trials:
            return None
        return self._next(entries, frozenset(pending))

    def skipped(self, history: History | None = None) -> list[PrunedSetting]:
        """Settings the strategy decided not to try given the history, with why (for status)."""
        return []

    @abstractmethod
    def _next(self, history: list[HistoryEntry], pending: frozenset[Setting]) -> Setting | None: ...
