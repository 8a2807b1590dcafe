"""The tuning core: pure, typed functions with no I/O (the clock and the seed are passed in).

    spec = batchtuning_spec.core()                    # the api model's spec in core types (core.tuning)
    plan = plan_candidates(spec.space, invariant, fits)
    search = Search.start("Adaptive", space, invariant, plan.pruned, slo, objective, seed, max_trials)
    setting = search.ask(history, pending)            # history: [(Setting, TrialOutcome), ...]
    load = protocol.next_load(steps, setting, neighbours, config)
    finished = trial_loop.run_trial(plan, world)           # one trial's runs, lengthening, curve step, conclusion
    step = protocol.close_step(load, runs, config)    # worst case over repeats, SLO verdict, margin
    conclusion = protocol.conclude(steps, config)     # the trial's metrics, verdict, reason
    selection = select_best(trials, objective, slo)   # best, knee, reasons
    result = verify.judge(slo, tolerance, before, after)

Modules: `vocabulary` (the words), `settings`, `planning`, `strategies`, `search`, `protocol` (one
trial), `measurement` (one load run's figures), `slo`, `objective`, `knee`, `selection`, `recommend`,
`verify`, `gpus`, `pods`, `manifests`, `promql`, `gitops`. Engine specifics live in `batchtune.engines`.
"""

from batchtune.core.knee import KNEE_GAIN_PERCENT, CurvePoint, Knee, curve_point, find_knee
from batchtune.core.objective import Objective, objective_value
from batchtune.core.outcomes import History, HistoryEntry, TrialOutcome
from batchtune.core.planning import (
    EngineLimits,
    FitCheck,
    FitVerdict,
    Plan,
    PrunedSetting,
    SearchSpace,
    plan_candidates,
)
from batchtune.core.selection import CompletedTrial, Selection, select_best
from batchtune.core.settings import Setting, percent_to_fraction
from batchtune.core.slo import SloTargets, SloVerdict, evaluate_slo
from batchtune.core.strategies import STRATEGIES, Adaptive, Bayesian, Grid, Strategy, make_strategy
from batchtune.core.vocabulary import MEMORY_REASONS, M, Phase, Reason, TrialState, Verdict

__all__ = [
    "Adaptive", "Bayesian", "CompletedTrial", "CurvePoint", "EngineLimits", "FitCheck", "FitVerdict", "Grid",
    "History", "HistoryEntry", "KNEE_GAIN_PERCENT", "Knee", "M", "MEMORY_REASONS", "Objective", "Phase", "Plan",
    "PrunedSetting", "Reason", "STRATEGIES", "SearchSpace", "Selection", "Setting", "SloTargets", "SloVerdict",
    "Strategy", "TrialOutcome", "TrialState", "Verdict", "curve_point", "evaluate_slo", "find_knee", "make_strategy",
    "objective_value", "percent_to_fraction", "plan_candidates", "select_best",
]
