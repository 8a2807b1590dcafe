"""The memory prefilter our strategies plan with, offered to the operator-style baselines one setting at a time.

Ours plan with `core.planning.plan_candidates` through `ours.plan_for`: the engine's own refusals (vLLM's scheduler
checks) and the twin's memory estimator prune settings before any trial, unbilled. A user of doubling, hill climbing
or Optuna given the same estimator would ask it before starting a server, so a baseline with a `fits` asks that
very plan (no copy of its rules): a setting the plan prunes is not started and bills nothing, and the baseline reads
it as it reads a setting that does not start (doubling's climb stops, hill climbing stops stepping that way, Optuna
is told a failed trial's value). Settings the estimator is unsure of (a runtime-OOM risk: "fit unknown") are kept,
as ours keep them. `fits` None: no prefilter, the published baselines as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from batchtune.bench.evaluate import TrialResult
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.strategies.ours import FitFn, knobs_of, plan_for
from batchtune.bench.types import Knobs

PRUNED = "pruned by the memory prefilter before a start"


@dataclass
class Prefilter:
    scenario: Scenario
    fits: FitFn | None
    """The estimator ours get (`TwinTruth().fits`, the nominal twin's); None: no prefilter."""
    _pruned: dict[Knobs, str] = field(default_factory=dict, init=False)
    _planned: set[Knobs] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        if self.fits is not None:
            self._plan(self.scenario)

    def _plan(self, scenario: Scenario) -> None:
        _, _, plan = plan_for(scenario, self.fits)
        pruned = {knobs_of(p.setting): p.message for p in plan.pruned}
        self._pruned.update(pruned)
        self._planned.update(knobs_of(s) for s in plan.candidates)
        self._planned.update(pruned)

    def refuses(self, knobs: Knobs) -> str | None:
        """Why the plan prunes this setting, or None when it would be tried (or there is no prefilter)."""
        if self.fits is None:
            return None
        if knobs not in self._planned:  # off the tuner grid (or an engine-default budget beside concrete ones)
            self._plan(
                replace(
                    self.scenario,
                    tuner_space=KnobGrid(
                        (knobs.max_num_seqs,), (knobs.gpu_memory_utilization_pct,), (knobs.max_num_batched_tokens,)
                    ),
                )
            )
            self._planned.add(knobs)
        return self._pruned.get(knobs)

    def skipped(self, knobs: Knobs) -> TrialResult | None:
        """The trial a pruned setting stands for (not started, nothing billed), or None when it is to be run."""
        reason = self.refuses(knobs)
        if reason is None:
            return None
        return TrialResult(knobs, False, 0.0, False, None, None, f"{PRUNED}: {reason}")
