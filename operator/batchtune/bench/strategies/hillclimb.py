"""A quick search in the style of Triton Model Analyzer's `quick` mode: hill-climb one knob at a time
from small values, geometrically for the batch knob, while the objective improves and the
constraints hold; then step gpu-memory-utilization the same way. Given the memory prefilter (`fits`,
`prefilter.Prefilter`) a setting the plan prunes is not started (nothing billed) and stops the climb that way, as a
failed start would."""

from __future__ import annotations

from dataclasses import dataclass

from batchtune.bench.evaluate import TrialResult, TrialRunner
from batchtune.bench.scenarios import Scenario
from batchtune.bench.strategies.ours import FitFn
from batchtune.bench.strategies.prefilter import Prefilter
from batchtune.bench.types import Choice, Knobs, Testbed


@dataclass(frozen=True)
class HillClimb:
    name: str = "hill_climb"
    min_gain: float = 0.01
    """An improvement smaller than this is noise, not a step uphill."""
    fits: FitFn | None = None
    """The memory prefilter ours plan with; None: none (the search as published)."""

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        space = scenario.tuner_space
        seqs = space.max_num_seqs
        gmus = space.gpu_memory_utilization_pct
        mbt = space.max_num_batched_tokens[0]
        gmu_index = min(range(len(gmus)), key=lambda i: abs(gmus[i] - scenario.default_gmu_pct))
        runner = TrialRunner(testbed, scenario)
        prefilter = Prefilter(scenario, self.fits)
        seen: dict[Knobs, TrialResult] = {}

        def trial(knobs: Knobs) -> TrialResult:
            if knobs not in seen:
                seen[knobs] = prefilter.skipped(knobs) or runner.run(knobs)
            return seen[knobs]

        # Phase 1: the batch knob, doubling through the candidate list from its smallest value.
        best = trial(Knobs(seqs[0], gmus[gmu_index], mbt))
        seq_index = 0
        while seq_index + 1 < len(seqs):
            candidate = trial(Knobs(seqs[seq_index + 1], gmus[gmu_index], mbt))
            if not candidate.met or candidate.objective <= best.objective * (1 + self.min_gain):
                break
            best, seq_index = candidate, seq_index + 1
        # Phase 2: memory, stepping up from the default, then down if up never helped.
        for direction in (+1, -1):
            moved = False
            index = gmu_index
            while 0 <= index + direction < len(gmus):
                candidate = trial(Knobs(best.knobs.max_num_seqs, gmus[index + direction], mbt))
                if not candidate.met or candidate.objective <= best.objective * (1 + self.min_gain):
                    break
                best, index, moved = candidate, index + direction, True
            if moved:
                break
        # Phase 3: with the memory settled, one more batch step up (more KV may lift the knee).
        seq_index = seqs.index(best.knobs.max_num_seqs)
        while seq_index + 1 < len(seqs):
            candidate = trial(Knobs(seqs[seq_index + 1], best.knobs.gpu_memory_utilization_pct, mbt))
            if not candidate.met or candidate.objective <= best.objective * (1 + self.min_gain):
                break
            best, seq_index = candidate, seq_index + 1
        if not best.met:
            return Choice(None, None, "no setting met the SLO")
        pruned = len(seen) - len(runner.results)
        note = f"{len(runner.results)} settings climbed" + (f", {pruned} pruned unbilled" if pruned else "")
        return Choice(best.knobs, best.claimed_load, note)
