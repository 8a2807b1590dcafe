"""The bench's twin-guided figures do not depend on the machine's load (issue 21: a reproducible benchmark).

The operator bounds the twin guide's search by the wall clock; the bench bounds it by its count of simulations, so a
starved run (a clock that runs past the operator's budget at once) gives the same choice as an idle one.
"""

from __future__ import annotations

import itertools

import pytest

from batchtune.bench.scenarios import get_scenarios
from batchtune.bench.strategies.simonly import SimulationOnly
from batchtune.twin import guide


def _choice(monkeypatch: pytest.MonkeyPatch, starved: bool) -> tuple[object, object]:
    if starved:
        ticks = itertools.count(0.0, guide.SEARCH_BUDGET_S * 10)
        monkeypatch.setattr(guide.time, "monotonic", lambda: float(next(ticks)))
    scenario = get_scenarios(["chat-8b-h100-tight"], quick=True)[0]
    choice = SimulationOnly().tune(None, scenario, seed=0)  # type: ignore[arg-type]  # it runs no trial
    monkeypatch.undo()
    return choice.knobs, choice.claimed_load


def test_a_starved_clock_changes_nothing_the_bench_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _choice(monkeypatch, starved=True) == _choice(monkeypatch, starved=False)


def test_the_operator_still_stops_at_its_wall_clock_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same search with the operator's budget simulates fewer finalists on a starved clock.
    scenario = get_scenarios(["chat-8b-h100-tight"], quick=True)[0]
    from batchtune.bench.strategies.ours import deployment_for, plan_for

    _, _, plan = plan_for(scenario, None)
    deployment = deployment_for(scenario, headroom_pct=0)
    ticks = itertools.count(0.0, guide.SEARCH_BUDGET_S * 10)
    monkeypatch.setattr(guide.time, "monotonic", lambda: float(next(ticks)))
    cut = guide.rank(deployment, plan.candidates)
    monkeypatch.undo()
    idle = guide.rank(deployment, plan.candidates)
    assert sum(p.simulated for p in cut) < sum(p.simulated for p in idle)
