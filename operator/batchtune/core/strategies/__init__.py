"""Search strategies in ask/tell shape: Grid, Adaptive, Bayesian and TwinGuided."""

from __future__ import annotations

from batchtune.core.guidance import TwinAdvice
from batchtune.core.objective import Objective
from batchtune.core.planning import Plan
from batchtune.core.slo import SloTargets
from batchtune.core.strategies._adaptive import Adaptive, blocked_reason
from batchtune.core.strategies._base import Strategy
from batchtune.core.strategies._bayesian import Bayesian
from batchtune.core.strategies._grid import Grid
from batchtune.core.strategies._twin_guided import TwinGuided

STRATEGIES: dict[str, type[Strategy]] = {"Grid": Grid, "Adaptive": Adaptive, "Bayesian": Bayesian,
                                         "TwinGuided": TwinGuided}


def make_strategy(
    kind: str,
    plan: Plan,
    slo: SloTargets,
    objective: Objective | str = Objective.SLO_CAPACITY,
    seed: int = 0,
    max_trials: int = 12,
    advice: TwinAdvice | None = None,
) -> Strategy:
    """`advice`: what the calibrated twin says (TwinGuided reads it; the others ignore it)."""
    kind = getattr(kind, "value", kind)
    if kind not in STRATEGIES:
        raise ValueError(f"strategy.type {kind!r} is not one of {', '.join(STRATEGIES)}")
    if kind == TwinGuided.kind:
        return TwinGuided(plan, slo, objective, seed, max_trials, advice)
    return STRATEGIES[kind](plan, slo, objective, seed, max_trials)


__all__ = ["Adaptive", "Bayesian", "Grid", "STRATEGIES", "Strategy", "TwinGuided", "blocked_reason", "make_strategy"]
