"""Optuna's TPE sampler with its default settings over the tuner's grid, for a fixed trial budget."""

from __future__ import annotations

from dataclasses import dataclass

from batchtune.bench.evaluate import TrialResult, TrialRunner
from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Choice, Knobs, Testbed


@dataclass(frozen=True)
class OptunaTpe:
    budget: int
    """Number of trials (servers started), normally what our Adaptive strategy used on the scenario."""
    name: str = "optuna_tpe"

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = scenario.tuner_space
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        runner = TrialRunner(testbed, scenario)
        results: dict[Knobs, TrialResult] = {}
        mbt_choices = list(space.max_num_batched_tokens)
        for _ in range(self.budget):
            trial = study.ask()
            knobs = Knobs(
                trial.suggest_categorical("max_num_seqs", list(space.max_num_seqs)),
                trial.suggest_categorical("gpu_memory_utilization_pct", list(space.gpu_memory_utilization_pct)),
                mbt_choices[trial.suggest_categorical("mbt_index", list(range(len(mbt_choices))))],
            )
            # TPE resamples seen points; a rerun is a new (billed) trial with a new noisy reading.
            result = runner.run(knobs)
            results[knobs] = result
            study.tell(trial, result.objective)
        met = [r for r in results.values() if r.met]
        if not met:
            return Choice(None, None, "no trial met the SLO")
        best = max(met, key=lambda r: r.objective)
        return Choice(best.knobs, best.claimed_load, f"best of {self.budget} trials")
