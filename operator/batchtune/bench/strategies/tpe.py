"""Optuna's TPE sampler over the tuner's grid, for a fixed trial budget, set up to be TPE within that budget.

With its defaults (`n_startup_trials=10`) TPE samples at random for its first 10 trials, so at this bench's budgets
(what Adaptive used: about 4-13 servers) it was random search with at most 3 modelled trials. Here:

- `n_startup_trials` = a third of the budget, rounded up, at least 2 (one point each for the "good" and "bad"
  densities TPE divides) and at most Optuna's default 10 (`startup_trials`); the rest of the budget is TPE's.
- `multivariate=True`: the knobs interact (the KV pool is gmu's and max-num-seqs' together), so one joint density,
  not one per knob (Optuna 5's default for one objective; stated so it holds on Optuna 4 too).
- the ordered knobs are integer indices into their sorted candidate lists (max-num-seqs in doubling steps, the gmu
  ladder, the token budgets), not categories: TPE's categorical estimator gives every value its own weight with no
  neighbours, so in a dozen trials over a grid of about a hundred it could only favour values already drawn; an
  index lets a good reading raise its neighbours. A grid whose token budgets include the engine default (None) keeps
  them a category (None has no place in the order).

TPE resamples points it has seen: a resampled setting is run again, as a new trial with a new noisy reading, billed
and counted against the budget (the latest reading stands for the setting); the choice's note counts them.

Given the memory prefilter (`fits`, `prefilter.Prefilter`) an asked setting the plan prunes is not started: TPE is
told the value of a failed start (0), nothing is billed, and it does not count against the budget (which counts
servers started, as Adaptive's does); at most `budget + grid size` asks end a study that keeps proposing pruned
settings.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchtune.bench.evaluate import TrialResult, TrialRunner
from batchtune.bench.scenarios import KnobGrid, Scenario
from batchtune.bench.strategies.ours import FitFn
from batchtune.bench.strategies.prefilter import Prefilter
from batchtune.bench.types import Choice, Knobs, Testbed

if TYPE_CHECKING:
    import optuna

MIN_STARTUP_TRIALS = 2
DEFAULT_STARTUP_TRIALS = 10
"""Optuna's `TPESampler` default."""


def startup_trials(budget: int) -> int:
    """The random trials before TPE models: a third of the budget, rounded up, within 2..10."""
    return min(DEFAULT_STARTUP_TRIALS, max(MIN_STARTUP_TRIALS, math.ceil(budget / 3)))


@dataclass(frozen=True)
class OptunaTpe:
    budget: int
    """Number of trials (servers started), normally what our Adaptive strategy used on the scenario."""
    name: str = "optuna_tpe"
    fits: FitFn | None = None
    """The memory prefilter ours plan with; None: none."""

    def sampler(self, seed: int) -> optuna.samplers.TPESampler:
        import optuna

        with warnings.catch_warnings():  # multivariate is experimental on Optuna 4
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=startup_trials(self.budget), multivariate=True
            )

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = scenario.tuner_space
        study = optuna.create_study(direction="maximize", sampler=self.sampler(seed))
        runner = TrialRunner(testbed, scenario)
        prefilter = Prefilter(scenario, self.fits)
        results: dict[Knobs, TrialResult] = {}
        resampled = pruned = asks = 0
        while len(runner.results) < self.budget and asks < self.budget + space.size:
            trial = study.ask()
            asks += 1
            knobs = _suggest(trial, space)
            if prefilter.refuses(knobs) is not None:
                study.tell(trial, 0.0)  # what a failed start tells it, without the start
                pruned += 1
                continue
            # TPE resamples seen points; a rerun is a new (billed) trial with a new noisy reading.
            resampled += knobs in results
            result = runner.run(knobs)
            results[knobs] = result
            study.tell(trial, result.objective)
        met = [r for r in results.values() if r.met]
        note = f"best of {len(runner.results)} trials ({resampled} resampled a seen setting"
        note += f", {pruned} asks pruned unbilled)" if pruned else ")"
        if not met:
            return Choice(None, None, f"no trial met the SLO; {note}")
        best = max(met, key=lambda r: r.objective)
        return Choice(best.knobs, best.claimed_load, note)


def _suggest(trial: optuna.trial.Trial, space: KnobGrid) -> Knobs:
    seqs, gmus = space.max_num_seqs, space.gpu_memory_utilization_pct  # ascending (KnobGrid checks)
    mbts: list[Any] = list(space.max_num_batched_tokens)
    if None in mbts:
        mbt = mbts[trial.suggest_categorical("mbt_index", list(range(len(mbts))))]
    else:
        mbts.sort()
        mbt = mbts[trial.suggest_int("mbt_index", 0, len(mbts) - 1)]
    return Knobs(
        seqs[trial.suggest_int("max_num_seqs_index", 0, len(seqs) - 1)],
        gmus[trial.suggest_int("gpu_memory_utilization_index", 0, len(gmus) - 1)],
        mbt,
    )
