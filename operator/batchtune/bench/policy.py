"""The policy-consistent oracle: the operator's own selection policy applied to the true values.

Batchtune's selection does not take the unconstrained best: it measures each setting's capacity against the SLO less
its headroom (`slo.headroomPercent`, 10 % by default: a latency target T passes at T * 0.9), and it steps back to the
knee of a max-num-seqs column when that costs no more than the headroom (`core.selection`, `core.knee`). A deliberate
step back is the policy, not a search error. So each choice is also judged against what that policy picks when every
setting of the strategies' grid is known exactly: the noise-free truth, the tightened SLO, the same `select_best`.

- *policy-consistent regret* = 1 - objective(choice) / objective(policy's pick), 0 at or above it; both objectives
  are the true ones at the scenario's own SLO (the headroom is the policy's margin, not the objective's unit);
- *the policy gives up* = 1 - objective(policy's pick) / the unconstrained oracle's best, per case.

Knee points are each setting's true reading at its (tightened) capacity, as a trial's conclusion holds them; a
setting a full token-budget burst crashes scores 0 in the judge (`Judge.objective`), so the policy never picks it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from batchtune.bench.evaluate import Judge, slo_targets, status_metrics
from batchtune.bench.scenarios import Scenario
from batchtune.bench.testbed import GroundTruth
from batchtune.bench.types import Knobs, Slo
from batchtune.core.objective import Objective
from batchtune.core.outcomes import TrialOutcome, TrialState, Verdict
from batchtune.core.selection import CompletedTrial, select_best
from batchtune.core.settings import Setting

POLICY_HEADROOM_PCT = 10
"""The BatchTuning default `slo.headroomPercent` (what `CoreStrategy` tunes with)."""


@dataclass(frozen=True)
class PolicyPick:
    knobs: Knobs | None
    objective: float
    """The pick's true objective at the scenario's own SLO (0 when the policy picks nothing)."""
    reason: str


def tightened(scenario: Scenario, headroom_pct: int) -> Scenario:
    """The scenario with every SLO limit less the headroom, as `core.slo` judges a trial."""
    factor = (100 - headroom_pct) / 100
    return replace(scenario, slo=Slo({k: v * factor for k, v in scenario.slo.limits.items()}))


def policy_pick(judge: Judge, truth: GroundTruth, *, headroom_pct: int = POLICY_HEADROOM_PCT,
                tight_judge: Judge | None = None) -> PolicyPick:
    """`judge`: the scenario's noise-free judge at its own SLO (for the pick's objective); `tight_judge`: one at the
    tightened SLO (made here when None; pass one to reuse or cache its evaluations)."""
    scenario = judge.scenario
    tight = tight_judge or Judge(tightened(scenario, headroom_pct), truth, window_s=judge.window_s)
    objective = Objective.SLO_CAPACITY if scenario.objective == "capacity" else Objective.OUTPUT_THROUGHPUT
    slo = slo_targets(scenario, headroom_pct)
    trials = []
    for knobs in scenario.tuner_space.grid():
        evaluation = tight.objective(knobs)
        if not evaluation.feasible:
            continue
        metrics = status_metrics(evaluation.reading, tight.scenario, slo.percentile)
        outcome = TrialOutcome(TrialState.DONE, Verdict.MET, objective=evaluation.objective, metrics=metrics)
        trials.append(CompletedTrial(knobs.label(), Setting(knobs.max_num_seqs, knobs.gpu_memory_utilization_pct,
                                                            knobs.max_num_batched_tokens), outcome))
    selection = select_best(trials, objective, slo)
    if selection.best is None:
        return PolicyPick(None, 0.0, selection.reason)
    best = selection.best
    knobs = Knobs(best.max_num_seqs, best.gpu_memory_utilization_percent, best.max_num_batched_tokens)
    return PolicyPick(knobs, judge.objective(knobs).objective, selection.reason)


def policy_regret(policy_objective: float, chosen: float) -> float:
    """1 - chosen / the policy's pick, in [0, 1]; 0 when the policy picks nothing (nothing to be consistent with)."""
    if policy_objective <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - chosen / policy_objective))
