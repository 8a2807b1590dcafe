"""Grid: every candidate, column by column (gmu, mbt), small max-num-seqs first."""

from __future__ import annotations

from batchtune.core.outcomes import HistoryEntry
from batchtune.core.settings import Setting
from batchtune.core.strategies._base import Strategy


class Grid(Strategy):
    kind = "Grid"

    def _next(self, history: list[HistoryEntry], pending: frozenset[Setting]) -> Setting | None:
        tried = {setting for setting, _ in history} | pending
        return next((s for s in self.plan.candidates if s not in tried), None)
