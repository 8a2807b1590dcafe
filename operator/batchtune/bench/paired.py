"""Paired comparisons over scenario x truth-seed cases, and per-strategy regret distributions.

Every strategy runs in the same world per case (common random numbers, `testbed.SimTestbed`), so the comparison is
paired: per case the difference of regrets, other minus the default's. Two statements of confidence, both over the
cases (not over repeats within one):

- an exact two-sided **sign test** on the cases where the two differ (ties dropped): the probability of a split at
  least this uneven if either were as likely to win a case;
- a percentile **bootstrap** 95 % interval of the mean regret difference (cases resampled with replacement, seeded).

Neither numpy nor scipy is a declared dependency of batchtune, so both are written out here (`math.comb`).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchtune.bench.runner import ScenarioResult, StrategyRun

DEFAULT_STRATEGY = "adaptive"
"""The operator's default (`spec.strategy.kind: Adaptive`), what every other strategy is paired against."""
TIE = 1e-9
"""Regret differences at most this are ties: the sign test drops them."""
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: P(a split at least as uneven as wins:losses | each side wins with p 1/2)."""
    if wins < 0 or losses < 0:
        raise ValueError("counts are >= 0")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = math.fsum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def bootstrap_ci(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, level: float = CONFIDENCE,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (seeded: the same values give the same interval)."""
    if not values:
        return (math.nan, math.nan)
    rng = random.Random(seed)
    n = len(values)
    means = sorted(math.fsum(rng.choices(values, k=n)) / n for _ in range(resamples))
    alpha = (1.0 - level) / 2.0
    return (quantile(means, alpha), quantile(means, 1.0 - alpha))


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class PairedComparison:
    """The default against one other strategy over the cases both ran."""

    default: str
    other: str
    cases: int
    default_better: int
    other_better: int
    ties: int
    mean_difference: float
    """Mean over cases of regret(other) - regret(default): > 0 favours the default."""
    ci_low: float
    ci_high: float
    sign_test_p: float


@dataclass(frozen=True)
class RegretDistribution:
    strategy: str
    cases: int
    median: float
    p90: float
    max: float
    within_1pct: int
    within_3pct: int
    violating: int
    """Choices that miss the SLO at the load they claim (noise-free) or, where recorded, are unsafe."""
    no_choice: int
    unsafe: int
    """Choices that a full token-budget burst crashes (the runtime-OOM rule, `core.burst`)."""
    policy_median: float = math.nan
    """The same figures of the policy-consistent regret (`bench.policy`)."""
    policy_p90: float = math.nan
    policy_max: float = math.nan
    policy_within_1pct: int = 0
    policy_within_3pct: int = 0


def _runs_by_case(results: Sequence[ScenarioResult]) -> dict[str, dict[str, StrategyRun]]:
    return {r.case: {run.strategy: run for run in r.runs} for r in results}


def strategy_names(results: Sequence[ScenarioResult]) -> list[str]:
    names: list[str] = []
    for result in results:
        names += [run.strategy for run in result.runs if run.strategy not in names]
    return names


def paired_comparisons(results: Sequence[ScenarioResult], default: str = DEFAULT_STRATEGY,
                       *, seed: int = 0) -> tuple[PairedComparison, ...]:
    by_case = _runs_by_case(results)
    out = []
    for other in strategy_names(results):
        if other == default:
            continue
        diffs = [runs[other].regret - runs[default].regret for runs in by_case.values()
                 if other in runs and default in runs]
        if not diffs:
            continue
        better = sum(d > TIE for d in diffs)
        worse = sum(d < -TIE for d in diffs)
        low, high = bootstrap_ci(diffs, seed=seed)
        out.append(PairedComparison(default, other, len(diffs), better, worse, len(diffs) - better - worse,
                                    statistics.fmean(diffs), low, high, sign_test_p(better, worse)))
    return tuple(out)


def distributions(results: Sequence[ScenarioResult]) -> tuple[RegretDistribution, ...]:
    out = []
    for name in strategy_names(results):
        runs = [run for r in results for run in r.runs if run.strategy == name]
        regrets = [run.regret for run in runs]
        policy = [run.policy_regret for run in runs]
        out.append(RegretDistribution(
            strategy=name, cases=len(runs), median=quantile(regrets, 0.5), p90=quantile(regrets, 0.9),
            max=max(regrets, default=math.nan), within_1pct=sum(r <= 0.01 + TIE for r in regrets),
            within_3pct=sum(r <= 0.03 + TIE for r in regrets), violating=sum(run.violates for run in runs),
            no_choice=sum(run.chosen is None for run in runs), unsafe=sum(run.unsafe for run in runs),
            policy_median=quantile(policy, 0.5), policy_p90=quantile(policy, 0.9), policy_max=max(policy, default=math.nan),
            policy_within_1pct=sum(r <= 0.01 + TIE for r in policy), policy_within_3pct=sum(r <= 0.03 + TIE for r in policy),
        ))
    return tuple(out)
