"""Search strategies in ask/tell shape: Grid, Adaptive and Bayesian."""

from __future__ import annotations

from batchtune.core.objective import Objective
from batchtune.core.planning import Plan
from batchtune.core.slo import SloTargets
from batchtune.core.strategies._adaptive import Adaptive, blocked_reason
from batchtune.core.strategies._base import Strategy
from batchtune.core.strategies._bayesian import Bayesian
from batchtune.core.strategies._grid import Grid

STRATEGIES: dict[str, type[Strategy]] = {"Grid": Grid, "Adaptive": Adaptive, "Bayesian": Bayesian}


def make_strategy(
    kind: str,
    plan: Plan,
    slo: SloTargets,
    objective: Objective | str = Objective.SLO_CAPACITY,
    seed: int = 0,
    max_trials: int = 12,
) -> Strategy:
    kind = getattr(kind, "value", kind)
    if kind not in STRATEGIES:
        raise ValueError(f"strategy.type {kind!r} is not one of {', '.join(STRATEGIES)}")
    return STRATEGIES[kind](plan, slo, objective, seed, max_trials)


__all__ = ["Adaptive", "Bayesian", "Grid", "STRATEGIES", "Strategy", "blocked_reason", "make_strategy"]
