"""The search over a plan: a strategy, rebuilt from what status holds, asked for the next setting.

Settings the memory prefilter pruned stay in the strategy's plan and enter its history as Infeasible
with the memory reason a failed start would have given: to a strategy they are what a failed trial
would have taught it (a column cut short by memory is KV-bound), learned without spending a GPU, and
outside `maxTrials`. Rebuilt from the same space, pruned list, seed and history, it asks the same.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from batchtune.core.guidance import TwinAdvice
from batchtune.core.objective import Objective
from batchtune.core.outcomes import HistoryEntry, TrialOutcome
from batchtune.core.planning import Invariant, PrunedSetting, SearchSpace, plan_candidates
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets
from batchtune.core.strategies import Strategy, make_strategy
from batchtune.core.vocabulary import Reason, TrialState, Verdict


def learned_from_pruned(pruned: Sequence[PrunedSetting], candidates: Collection[Setting]) -> list[HistoryEntry]:
    """The prefilter's memory prunes as Infeasible history entries."""
    out: list[HistoryEntry] = []
    for p in pruned:
        if p.reason is Reason.DOES_NOT_FIT_MEMORY and p.setting in candidates:
            reason = p.memory_reason or Reason.KV_CACHE_TOO_SMALL
            out.append((p.setting, TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=reason.value,
                                                message=p.message[:200])))
    return out


@dataclass(frozen=True)
class Search:
    strategy: Strategy
    learned: tuple[HistoryEntry, ...]

    @classmethod
    def start(cls, kind: str, space: SearchSpace, invariant: Invariant | None, pruned: Sequence[PrunedSetting],
              slo: SloTargets, objective: Objective | str, seed: int, max_trials: int,
              advice: TwinAdvice | None = None) -> Search:
        """`advice`: the calibrated twin's for this history (TwinGuided; see `core.guidance`)."""
        plan = plan_candidates(space, invariant)
        learned = learned_from_pruned(pruned, set(plan.candidates))
        strategy = make_strategy(kind, plan, slo, objective, seed, max_trials + len(learned), advice)
        return cls(strategy, tuple(learned))

    def ask(self, history: Sequence[HistoryEntry], pending: Collection[Setting] = ()) -> Setting | None:
        """The next setting to try, or None (with pending trials: wait for them; without: the search is over)."""
        return self.strategy.ask(self.history(history), pending)

    def history(self, history: Sequence[HistoryEntry]) -> list[HistoryEntry]:
        """What the strategy sees: the prefilter's lessons, then the trials."""
        return list(self.learned) + list(history)

    @property
    def candidates(self) -> tuple[Setting, ...]:
        return tuple(self.strategy.plan.candidates)
