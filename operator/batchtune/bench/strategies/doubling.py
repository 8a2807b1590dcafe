"""The doubling heuristic: double max-num-seqs from a small start at the default memory setting until
the knee (the marginal gain of the objective drops below a threshold, or the SLO/memory stops it), and
keep the batch size before the knee. Given the memory prefilter (`fits`, `prefilter.Prefilter`) it stops, unbilled,
at the first batch size the plan prunes, as a failed start would stop it."""

from __future__ import annotations

from dataclasses import dataclass

from batchtune.bench.evaluate import TrialResult, TrialRunner
from batchtune.bench.scenarios import Scenario
from batchtune.bench.strategies.ours import FitFn
from batchtune.bench.strategies.prefilter import Prefilter
from batchtune.bench.types import Choice, Knobs, Testbed


@dataclass(frozen=True)
class Doubling:
    name: str = "doubling"
    start_max_num_seqs: int = 8
    knee_gain: float = 0.10
    """A doubling that adds less than this fraction to the objective is past the knee."""
    fits: FitFn | None = None
    """The memory prefilter ours plan with; None: none (the heuristic as published)."""

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        space = scenario.tuner_space
        limit = max(space.max_num_seqs)
        mbt = space.max_num_batched_tokens[0]
        runner = TrialRunner(testbed, scenario)
        prefilter = Prefilter(scenario, self.fits)
        previous: TrialResult | None = None
        mns = self.start_max_num_seqs
        while mns <= limit:
            knobs = Knobs(mns, scenario.default_gmu_pct, mbt)
            trial = prefilter.skipped(knobs) or runner.run(knobs)
            if not trial.met:
                break  # the SLO or memory stopped the climb: the one before stands
            if previous is not None and trial.objective < previous.objective * (1 + self.knee_gain):
                break  # knee: this doubling barely paid; take the one before
            previous = trial
            mns *= 2
        if previous is None:
            return Choice(None, None, "the smallest batch already failed")
        return Choice(previous.knobs, previous.claimed_load, f"knee after max-num-seqs {previous.knobs.max_num_seqs}")
