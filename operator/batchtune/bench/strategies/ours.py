"""Our strategies (`batchtune.core`: Adaptive, Bayesian, TwinGuided) driven through their ask/tell interface,
with the core's planning, SLO evaluation (headroom included) and selection (knee), exactly as the
operator runs them; each asked setting becomes one operator-style trial on the testbed. TwinGuided is
given the advice of the nominal twin, recalibrated on every finished trial (`twin.guide.advise`), as
the operator's twin worker gives it; it never sees the truth's hidden parameters."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from batchtune.bench.evaluate import TrialProtocol, TrialResult, TrialRunner, slo_targets
from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Choice, Knobs, Testbed
from batchtune.core.burst import burst_failed, burst_of
from batchtune.core.objective import Objective
from batchtune.core.outcomes import HistoryEntry, TrialOutcome
from batchtune.core.planning import EngineLimits, FitVerdict, Plan, SearchSpace, plan_candidates
from batchtune.core.search import Search
from batchtune.core.selection import CompletedTrial, select_best
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import Reason, TrialState, Verdict
from batchtune.engines import VLLM

if TYPE_CHECKING:
    from batchtune.core.guidance import Predicted, TwinAdvice
    from batchtune.twin.guide import Deployment

UNTIMED = math.inf
"""The twin guide's search in the bench is bounded by its count of simulations (`SIMULATED_FINALISTS`), not by the
wall clock as in the operator: a starved run must give the same figures as an idle one."""

# (fits, reason) for one setting; fits None = unknown (kept), as the core's FitVerdict.
FitFn = Callable[[Scenario, Knobs], tuple[bool | None, str]]

def to_outcome(result: TrialResult, objective: Objective) -> TrialOutcome:
    """What the core's search learns from one bench trial: the protocol's conclusion, or the start failure
    classified by the engine adapter as the operator classifies a pod's termination message."""
    if not result.started or result.failure is not None or result.conclusion is None:
        reason = VLLM.classify_failure(result.failure or "") or Reason.CRASH_LOOP_BACK_OFF
        return TrialOutcome(TrialState.INFEASIBLE, Verdict.VIOLATED, reason=reason.value,
                            message=(result.failure or "")[:200])
    return result.conclusion.outcome(objective)


@dataclass(frozen=True)
class CoreStrategy:
    kind: str
    """`Adaptive` or `Bayesian` (any `make_strategy` kind)."""
    max_trials: int = 12
    """The BatchTuning default `maxTrials`."""
    headroom_pct: int = 10
    """The BatchTuning default `slo.headroomPercent`."""
    fits: FitFn | None = None
    """The memory-fit prefilter the operator plans with (the twin's estimator); None: none."""
    name: str = ""
    bracketing: bool = True
    """Short bracketing steps in the capacity search (the operator's default); False: every step full."""

    @property
    def label(self) -> str:
        return self.name or self.kind.lower()

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice:
        objective = objective_of(scenario)
        slo = slo_targets(scenario, self.headroom_pct)
        core_space, invariant, plan = plan_for(scenario, self.fits)
        if not plan.candidates:
            return Choice(None, None, plan.error or "empty plan")
        guided = self.kind == "TwinGuided"
        deployment = deployment_for(scenario, self.headroom_pct) if guided else None
        runner = TrialRunner(testbed, scenario, TrialProtocol(headroom_pct=self.headroom_pct,
                                                              bracketing=self.bracketing))
        history: list[HistoryEntry] = []
        completed: list[CompletedTrial] = []
        claimed: dict[Setting, TrialResult] = {}
        launched: dict[Setting, Predicted] = {}
        advice: TwinAdvice | None = None
        probed: set[Setting] = set()
        while True:
            # As the operator (`core.search`): what the memory prefilter pruned enters the history as Infeasible.
            search = Search.start(self.kind, core_space, invariant, plan.pruned, slo, objective, seed,
                                  self.max_trials, advice)
            if deployment is not None:
                advice = guide_advice(deployment, search.candidates, history, launched)
                search = Search.start(self.kind, core_space, invariant, plan.pruned, slo, objective, seed,
                                      self.max_trials, advice)
            setting = search.ask(history)
            if setting is None:
                # A runtime-OOM risk is not a fit: the setting about to be chosen is probed with a full token-budget
                # burst first; a failed burst goes into the history (it rules out its column) and the search goes on.
                selection = select_best(completed, objective, slo)
                if selection.best is None or selection.best in probed:
                    break
                probed.add(selection.best)
                failed = burst_probe(testbed, scenario, selection.best)
                if failed is None:
                    break
                history.append((selection.best, failed))
                completed.append(CompletedTrial(f"burst-{len(completed)}", selection.best, failed))
                continue
            # As the operator: an Untrusted calibration launches nothing on its predictions, not even the load.
            predicted = advice.launch_prediction(setting) if advice is not None else None
            if predicted is not None:
                launched[setting] = predicted
            result = runner.run(knobs_of(setting), predicted.capacity_load if predicted is not None else None)
            outcome = to_outcome(result, objective)
            history.append((setting, outcome))
            completed.append(CompletedTrial(f"trial-{len(completed)}", setting, outcome))
            claimed[setting] = result
        selection = select_best(completed, objective, slo)
        report = predictions_report(history, launched, advice, search) if guided else ()
        if selection.best is None:
            return Choice(None, None, selection.reason, report)
        chosen = claimed[selection.best]
        return Choice(knobs_of(selection.best), chosen.claimed_load, selection.reason, report)


def burst_probe(testbed: Testbed, scenario: Scenario, setting: Setting) -> TrialOutcome | None:
    """Run the setting's full token-budget burst (`core.burst`) on a server of it: None when it held, else the
    outcome the search and selection learn (BurstOutOfMemory). The budget and model length are the engine's
    defaults where the setting leaves them unset (the nominal twin's config: arithmetic, no hidden parameter)."""
    from batchtune.bench.twin_truth import TwinTruth

    knobs = knobs_of(setting)
    config = TwinTruth().config(scenario, knobs)
    burst = burst_of(setting, config.max_num_batched_tokens, config.max_model_len)
    if testbed.running != knobs:
        start = testbed.start(knobs)
        if not start.ok:
            return burst_failed(setting, burst, start.error or "the server did not start")
    reading = testbed.run_burst(burst)
    return None if reading.ok else burst_failed(setting, burst, reading.failure or "the server failed")


def objective_of(scenario: Scenario) -> Objective:
    return Objective.SLO_CAPACITY if scenario.objective == "capacity" else Objective.OUTPUT_THROUGHPUT


def plan_for(scenario: Scenario, fits: FitFn | None) -> tuple[SearchSpace, Callable[[Setting], str | None], Plan]:
    """The core's search space, the engine invariant and the plan (with the memory prefilter), as the operator."""
    space = scenario.tuner_space
    mbts = tuple(m for m in space.max_num_batched_tokens if m is not None)
    core_space = SearchSpace(space.max_num_seqs, space.gpu_memory_utilization_pct, mbts)
    fit = None
    if fits is not None:
        check = fits

        def fit(setting: Setting) -> FitVerdict:
            ok, reason = check(scenario, knobs_of(setting))
            return FitVerdict(ok, reason, VLLM.classify_failure(reason) if ok is False else None)

    limits = EngineLimits(max_model_len=scenario.max_model_len)

    def invariant(setting: Setting) -> str | None:
        return VLLM.invariant_violation(setting, limits)

    return core_space, invariant, plan_candidates(core_space, invariant, fit, limits)


def deployment_for(scenario: Scenario, headroom_pct: int) -> Deployment:
    """What the twin guide knows of a scenario: the nominal twin of its model and GPU, its load and SLO."""
    from batchtune.twin.config import ServeConfig
    from batchtune.twin.guide import Deployment
    from batchtune.twin.steady import Shape

    config = TrialProtocol(headroom_pct=headroom_pct).config(scenario)
    base = ServeConfig(model=scenario.model, gpu=scenario.gpu, tensor_parallel_size=scenario.tensor_parallel_size,
                       max_model_len=scenario.max_model_len)
    return Deployment(base, Shape(scenario.input_len, scenario.output_len, scenario.length_dist),
                      config.slo, config.objective, config.open_loop, scenario.window_s, config.fixed_load)


def guide_advice(deployment: Deployment, candidates: tuple[Setting, ...], history: list[HistoryEntry],
                 launched: dict[Setting, Predicted]) -> TwinAdvice:
    from batchtune.core.guidance import measured, truncated

    done = measured(history)
    if not history:  # the nominal twin's advice depends on nothing else: compute it once
        return truncated(_nominal_advice(deployment, candidates), [])
    from batchtune.twin.guide import advise

    # As the operator's status keeps it: the best predictions and those of the measured settings.
    return truncated(advise(deployment, candidates, history, launched, budget_s=UNTIMED)[0], [s for s, _ in done])


@lru_cache(maxsize=64)
def _nominal_advice(deployment: Deployment, candidates: tuple[Setting, ...]) -> TwinAdvice:
    from batchtune.twin.guide import advise

    return advise(deployment, candidates, [], budget_s=UNTIMED)[0]


def predictions_report(history: list[HistoryEntry], launched: dict[Setting, Predicted], advice: TwinAdvice | None,
                       search: Search) -> tuple[dict[str, object], ...]:
    """Predicted against measured for every trial launched on a prediction, and how the search ended."""
    rows: list[dict[str, object]] = []
    for setting, outcome in history:
        predicted = launched.get(setting)
        if predicted is None:
            continue
        agreement = advice.agreements.get(setting) if advice is not None else None
        first = outcome.steps[0] if outcome.steps else None
        rows.append({"setting": setting.label(), "predicted_objective": round(predicted.objective, 4),
                     "measured_objective": None if outcome.objective is None else round(outcome.objective, 4),
                     "predicted_load": predicted.capacity_load, "first_step_load": first.load if first else None,
                     "agrees": None if agreement is None else agreement.agrees,
                     "worst": None if agreement is None else agreement.worst})
    strategy = search.strategy
    mode = getattr(strategy, "mode", None)
    if mode is not None:
        rows.append({"mode": mode(search.history(history))[0]})
    return tuple(rows)


def knobs_of(setting: Setting) -> Knobs:
    return Knobs(setting.max_num_seqs, setting.gpu_memory_utilization_percent, setting.max_num_batched_tokens)
