"""The oracle: exhaustive noise-free evaluation of a scenario's fine grid."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from batchtune.bench.evaluate import Evaluation, Judge
from batchtune.bench.types import Knobs, Load

# Settings whose objectives differ by less than this are ties (the search tolerance of the load).
TIE_TOLERANCE = 0.005


@dataclass(frozen=True)
class OracleResult:
    best: Evaluation
    grid_size: int
    feasible: int
    best_at_max_gmu: float
    """Best objective among settings at the grid's largest gmu."""
    max_gmu_pct: int
    saturation_preemptions_per_s: float
    """Preemption rate of the largest batch at the default gmu under a full closed loop (KV pressure)."""

    @property
    def objective(self) -> float:
        return self.best.objective

    @property
    def best_gmu_below_max(self) -> bool:
        """True when every setting at the largest gmu is worse than the best by more than the tie tolerance."""
        return self.best_at_max_gmu < self.best.objective * (1 - 2 * TIE_TOLERANCE)


def run_oracle(judge: Judge, extra: Iterable[Knobs] = ()) -> OracleResult:
    space = judge.scenario.oracle_space
    on_grid = space.grid()
    evaluations = []
    previous: Evaluation | None = None
    for knobs in on_grid:
        # Neighbours along max-num-seqs have close capacities: start each search at the last one.
        same_column = previous is not None and _column(previous.knobs) == _column(knobs)
        hint = previous.load.value if same_column and previous is not None and previous.load is not None else None
        previous = judge.objective(knobs, hint=hint)
        evaluations.append(previous)
    grid_set = set(on_grid)
    for knobs in dict.fromkeys(k for k in extra if k not in grid_set):
        # An off-grid setting starts at its nearest grid neighbour's capacity, never at whichever setting came
        # before it in `extra`: its value (and the cache's) is then the same whatever else was chosen.
        evaluations.append(judge.objective(knobs, hint=_nearest_capacity(evaluations[:len(on_grid)], knobs)))
    best = max(evaluations, key=_rank)
    max_gmu = max(space.gpu_memory_utilization_pct)
    at_max = [e.objective for e in evaluations if e.knobs.gpu_memory_utilization_pct == max_gmu]
    return OracleResult(
        best=best,
        grid_size=len(evaluations),
        feasible=sum(e.feasible for e in evaluations),
        best_at_max_gmu=max(at_max, default=0.0),
        max_gmu_pct=max_gmu,
        saturation_preemptions_per_s=_saturation_preemptions(judge),
    )


def _column(knobs: Knobs) -> tuple[int, int | None]:
    return knobs.gpu_memory_utilization_pct, knobs.max_num_batched_tokens


def _nearest_capacity(grid: list[Evaluation], knobs: Knobs) -> float | None:
    """The capacity of the grid setting nearest to `knobs` (same token budget first, then gmu, then max-num-seqs
    in ratio), or None when it has none: a function of `knobs` and the grid only."""
    def distance(e: Evaluation) -> tuple[bool, int, float, int, int]:
        k = e.knobs
        return (k.max_num_batched_tokens != knobs.max_num_batched_tokens,
                abs(k.gpu_memory_utilization_pct - knobs.gpu_memory_utilization_pct),
                abs(math.log(k.max_num_seqs / knobs.max_num_seqs)), k.gpu_memory_utilization_pct, k.max_num_seqs)

    nearest = min(grid, key=distance, default=None)
    return nearest.load.value if nearest is not None and nearest.load is not None else None


def _rank(e: Evaluation) -> tuple[float, int, int]:
    # Among equal objectives prefer less memory and smaller batches (what a careful operator would pick).
    return (round(e.objective, 6), -e.knobs.gpu_memory_utilization_pct, -e.knobs.max_num_seqs)


def _saturation_preemptions(judge: Judge) -> float:
    sc = judge.scenario
    knobs = Knobs(max(sc.oracle_space.max_num_seqs), sc.default_gmu_pct, sc.oracle_space.max_num_batched_tokens[0])
    if not judge.truth.startup(sc, knobs).ok:
        return 0.0
    reading = judge.measure(knobs, Load("concurrency", float(knobs.max_num_seqs)))
    return reading.get("preemptions_per_s", 0.0) if reading.ok else 0.0


def regret(oracle_best: float, chosen: float) -> float:
    """1 - chosen/best, in [0, 1]; a strategy that chose nothing has regret 1."""
    if oracle_best <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - chosen / oracle_best))
