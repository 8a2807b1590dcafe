"""Runs every strategy on every scenario, then judges the choices against the oracle."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

from batchtune.bench.evaluate import Judge
from batchtune.bench.oracle import OracleResult, regret, run_oracle
from batchtune.bench.policy import POLICY_HEADROOM_PCT, policy_pick, policy_regret, tightened
from batchtune.bench.scenarios import Scenario
from batchtune.bench.seeds import DEVELOPMENT_TRUTH_SEEDS
from batchtune.bench.strategies.autotune import AutoTune
from batchtune.bench.strategies.base import TuningStrategy
from batchtune.bench.strategies.doubling import Doubling
from batchtune.bench.strategies.hillclimb import HillClimb
from batchtune.bench.strategies.tpe import OptunaTpe
from batchtune.bench.testbed import CostModel, GroundTruth, SimTestbed, derive_seed
from batchtune.bench.types import Choice, Load

BASELINE = "auto_tune"
REFERENCE = "adaptive"
"""What a new strategy of ours must beat on GPU-minutes scenario by scenario."""
RECHECK_REPEATS = 3
REGRET_TARGET = 0.02
GPU_MINUTES_RATIO_TARGET = 0.25
MEMO_SIMULATIONS = 8192
"""Simulations one bench process keeps for reuse (`twin.predict.PredictMemo`; a few KiB each)."""


@dataclass(frozen=True)
class StrategyRun:
    strategy: str
    chosen: str | None
    chosen_knobs: dict[str, Any] | None
    claimed_load: str | None
    objective: float
    """Noise-free objective of the chosen setting."""
    regret: float
    violates: bool
    """The chosen setting misses the SLO at the load it claims (noise-free) or is `unsafe`; False when nothing was
    chosen."""
    noisy_violations: int
    trials: int
    failed_starts: int
    load_steps: int
    gpu_minutes: float
    note: str
    predictions: tuple[dict[str, Any], ...] = ()
    """Twin-guided strategies: predicted against measured for every trial launched on a prediction."""
    unsafe: bool = False
    """A full token-budget burst crashes the chosen setting on the truth (the runtime-OOM rule, `core.burst`)."""
    policy_regret: float = 0.0
    """Regret against the policy-consistent oracle (`bench.policy`): the selection policy applied to the truth."""
    lower_load_steps: int = 0
    """Load steps the truth served at another load than asked (the recorded engine: the next lower recorded one)."""
    within_noise_band: bool | None = None
    """A truth with recorded repeats: the choice's recorded objective band overlaps the best's (None elsewhere, or
    when nothing was chosen)."""


@dataclass(frozen=True)
class ScenarioResult:
    scenario: str
    summary: str
    tags: tuple[str, ...]
    objective_unit: str
    oracle_setting: str
    oracle_objective: float
    oracle_grid: int
    oracle_feasible: int
    tuner_grid_best: float
    """Best noise-free objective on the strategies' own (coarser) grid: the regret floor a perfect search
    over the candidates could reach is 1 - tuner_grid_best / oracle_objective."""
    best_gmu_below_max: bool
    saturation_preemptions_per_s: float
    runs: tuple[StrategyRun, ...]
    seconds: float
    truth: str = ""
    """The ground truth the scenario was judged on (for a perturbed one: its hidden parameters)."""
    truth_seed: int | None = None
    """The hidden reality's seed (None on a truth without seeds: the nominal twin, a test's)."""
    policy_setting: str | None = None
    """What the selection policy (SLO headroom, knee rule) picks from the strategies' grid on the true values."""
    policy_objective: float = 0.0
    """Its true objective at the scenario's own SLO."""
    noise_bands: tuple[dict[str, Any], ...] = ()
    """A truth with recorded repeats (`bench.recorded`): per setting of the strategies' grid its capacity load, its
    objective (the repeats' mean) and the repeats' spread there (`low`, `high`); empty on the simulated truths."""

    @property
    def policy_gives_up(self) -> float:
        """What the policy itself costs against the unconstrained best, 1 - policy / oracle."""
        return regret(self.oracle_objective, self.policy_objective)

    @property
    def case(self) -> str:
        """The scenario with its reality: one case of a paired comparison."""
        return self.scenario if self.truth_seed is None else f"{self.scenario}@{self.truth_seed}"


@dataclass(frozen=True)
class StrategySummary:
    strategy: str
    mean_regret: float
    max_regret: float
    scenarios_within_regret_target: int
    violating_choices: int
    no_choice: int
    """Scenarios where the strategy recommended nothing."""
    median_gpu_minutes_ratio: float | None
    """Median over scenarios of GPU-minutes / the auto_tune baseline's on the same scenario."""
    median_gpu_minutes_ratio_where_baseline_chose: float | None
    """The same median over the scenarios where auto_tune recommended a setting (it also fails cheaply)."""
    total_gpu_minutes: float
    mean_trials: float
    within_1pct: int = 0
    """Scenarios with regret <= 1 % (the twin-guided targets: 1 % on 12 of 13, 3 % on all)."""
    within_3pct: int = 0
    cheaper_than_reference: int | None = None
    """Scenarios where this strategy spent fewer GPU-minutes than Adaptive (None for Adaptive itself)."""


@dataclass(frozen=True)
class BenchResult:
    seed: int
    noise: float
    scenarios: tuple[ScenarioResult, ...]
    summary: tuple[StrategySummary, ...]
    seconds: float
    checks: tuple[str, ...] = field(default=())
    """Scenario design checks that failed (e.g. a gmu-below-max scenario whose oracle picks the max)."""
    truth: str = "nominal"
    """`nominal` (the twin the strategies plan with), `perturbed` (hidden realities, bench.reality) or `recorded` (real
    vLLM on CPU, bench.recorded)."""
    truth_seeds: tuple[int, ...] = ()
    """The realities every scenario was judged on (empty on a truth without seeds)."""
    development_truth_seeds: tuple[int, ...] = DEVELOPMENT_TRUTH_SEEDS
    """The realities the strategies' rules were developed on: a result on any of them is not held out."""

    @property
    def held_out(self) -> bool:
        return bool(self.truth_seeds) and not set(self.truth_seeds) & set(self.development_truth_seeds)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_strategies(truth: GroundTruth) -> list[TuningStrategy]:
    """Ours first: Optuna TPE's budget is what Adaptive used on the same scenario. Every twin a strategy
    uses (the memory prefilter, TwinGuided's guide, the simulation-only pick) is the nominal one, whatever
    the truth: a perturbed truth's hidden parameters reach no strategy. The memory prefilter is offered to every
    operator-style strategy (ours, doubling, hill climbing, Optuna TPE); auto_tune's script has its own memory probe
    and no place for one (docs/benchmarks.md, "What favours whom")."""
    from batchtune.bench.strategies.ours import CoreStrategy
    from batchtune.bench.strategies.simonly import SimulationOnly
    from batchtune.bench.twin_truth import TwinTruth

    fits = TwinTruth().fits
    return [
        CoreStrategy("TwinGuided", fits=fits, name="twin_guided"),
        CoreStrategy("Adaptive", fits=fits, name="adaptive"),
        # The same-run baseline of the cheaper trials: Adaptive with every load step measured for the full window.
        CoreStrategy("Adaptive", fits=fits, name="adaptive_full_windows", bracketing=False),
        CoreStrategy("Bayesian", fits=fits, name="bayesian"),
        SimulationOnly(fits=fits),
        AutoTune(),
        Doubling(fits=fits),
        HillClimb(fits=fits),
    ]


STRATEGY_NAMES = ("twin_guided", "adaptive", "adaptive_full_windows", "bayesian", "sim_only", "auto_tune", "doubling",
                  "hill_climb", "optuna_tpe")
"""Every strategy the bench runs, as its results name them (`default_strategies`, then Optuna TPE)."""
TPE_NAME = "optuna_tpe"


@dataclass(frozen=True)
class OnlyStrategies:
    """`--strategies`: only the named ones of `base` (default `default_strategies`); picklable for --jobs."""

    names: frozenset[str]
    base: Callable[[GroundTruth], Sequence[TuningStrategy]] | None = None

    def __call__(self, truth: GroundTruth) -> list[TuningStrategy]:
        return [s for s in (self.base or default_strategies)(truth) if _name(s) in self.names]


def _name(strategy: TuningStrategy) -> str:
    return getattr(strategy, "label", None) or strategy.name


def run_scenario(
    scenario: Scenario,
    truth: GroundTruth,
    *,
    seed: int,
    noise: float,
    strategies: Sequence[TuningStrategy] | None = None,
    cost: CostModel = CostModel(),
    with_tpe: bool = True,
    use_cache: bool = False,
    truth_seed: int | None = None,
) -> ScenarioResult:
    from batchtune.twin.predict import memoised

    # Repeated identical simulations (the judge's two SLOs, strategies measuring the same step in the same world,
    # the nominal twin's predictions) are served from the memo already installed (run_bench's), else one for the case.
    with memoised():
        return _run_scenario(scenario, truth, seed=seed, noise=noise, strategies=strategies, cost=cost,
                             with_tpe=with_tpe, use_cache=use_cache, truth_seed=truth_seed)


def _run_scenario(
    scenario: Scenario,
    truth: GroundTruth,
    *,
    seed: int,
    noise: float,
    strategies: Sequence[TuningStrategy] | None,
    cost: CostModel,
    with_tpe: bool,
    use_cache: bool,
    truth_seed: int | None,
) -> ScenarioResult:
    started = time.monotonic()
    strategies = list(strategies) if strategies is not None else default_strategies(truth)
    judge = Judge(scenario, truth)
    if use_cache:
        from batchtune.bench.cache import load_into

        load_into(judge)
    choices: list[tuple[str, Choice, SimTestbed]] = []
    for strategy in strategies:
        name = _name(strategy)
        # One world for every strategy (common random numbers): the testbed keys each reading's noise by the step.
        testbed = SimTestbed(scenario, truth, seed, noise, cost)
        choice = strategy.tune(testbed, scenario, seed=seed)
        choices.append((name, choice, testbed))
    if with_tpe:
        budget = next((tb.ledger.starts for n, _, tb in choices if n == "adaptive"), 12)
        from batchtune.bench.twin_truth import TwinTruth

        tpe = OptunaTpe(budget=max(1, budget), fits=TwinTruth().fits)
        testbed = SimTestbed(scenario, truth, seed, noise, cost)
        choices.append((tpe.name, tpe.tune(testbed, scenario, seed=seed), testbed))
    extra = [c.knobs for _, c, _ in choices if c.knobs is not None] + scenario.tuner_space.grid()
    oracle = run_oracle(judge, extra=extra)
    tuner_best = max(judge.objective(k).objective for k in scenario.tuner_space.grid())
    tight = Judge(tightened(scenario, POLICY_HEADROOM_PCT), truth, window_s=judge.window_s)
    if use_cache:
        from batchtune.bench.cache import load_into

        load_into(tight)
    pick = policy_pick(judge, truth, tight_judge=tight)
    if use_cache:
        from batchtune.bench.cache import save_from

        save_from(judge)
        save_from(tight)
    runs = tuple(_judge_choice(judge, oracle, name, choice, testbed, seed, noise, pick.objective)
                 for name, choice, testbed in choices)
    best = oracle.best
    bands = _noise_bands(judge, scenario)
    if bands:
        runs = tuple(replace(run, within_noise_band=_within_band(bands, run.chosen, best.knobs.label()))
                     for run in runs)
    return ScenarioResult(
        scenario=scenario.name,
        summary=scenario.summary,
        tags=scenario.tags,
        objective_unit=scenario.objective_unit,
        oracle_setting=best.knobs.label(),
        oracle_objective=best.objective,
        oracle_grid=oracle.grid_size,
        oracle_feasible=oracle.feasible,
        tuner_grid_best=tuner_best,
        best_gmu_below_max=oracle.best_gmu_below_max,
        saturation_preemptions_per_s=oracle.saturation_preemptions_per_s,
        runs=runs,
        seconds=time.monotonic() - started,
        truth=describe(scenario) if (describe := getattr(truth, "describe", None)) is not None else "",
        truth_seed=truth_seed,
        policy_setting=pick.knobs.label() if pick.knobs is not None else None,
        policy_objective=pick.objective,
        noise_bands=bands,
    )


def _noise_bands(judge: Judge, scenario: Scenario) -> tuple[dict[str, Any], ...]:
    """Per setting of the strategies' grid, where the truth knows its repeats' spread (`noise_band`): its capacity
    load, objective, and the repeats' lowest and highest objective there; empty on a truth without repeats."""
    band = getattr(judge.truth, "noise_band", None)
    if band is None:
        return ()
    out = []
    for knobs in scenario.tuner_space.grid():
        evaluation = judge.objective(knobs)
        low, high = band(knobs, evaluation.load) if evaluation.load is not None else (0.0, 0.0)
        out.append({"setting": knobs.label(), "load": evaluation.load.label() if evaluation.load else None,
                    "objective": evaluation.objective, "low": low, "high": high})
    return tuple(out)


def _within_band(bands: Sequence[dict[str, Any]], chosen: str | None, best: str) -> bool | None:
    """The chosen setting's band of recorded objectives overlaps the best's (its highest repeat reaches the best's
    lowest); None when nothing was chosen or either is off the grid."""
    by_setting = {b["setting"]: b for b in bands}
    if chosen is None or chosen not in by_setting or best not in by_setting:
        return None
    mine, top = by_setting[chosen], by_setting[best]
    return bool(mine["objective"] > 0 and mine["high"] >= top["low"])


def _judge_choice(
    judge: Judge, oracle: OracleResult, name: str, choice: Choice, testbed: SimTestbed, seed: int, noise: float,
    policy_objective: float = 0.0,
) -> StrategyRun:
    ledger = testbed.ledger
    make_run = partial(
        StrategyRun, strategy=name, trials=ledger.starts, failed_starts=ledger.failed_starts,
        load_steps=ledger.load_steps, gpu_minutes=ledger.gpu_minutes, note=choice.note,
        lower_load_steps=ledger.lower_load_steps,
        predictions=tuple(dict(p) for p in choice.predictions),
    )
    if choice.knobs is None:
        return make_run(chosen=None, chosen_knobs=None, claimed_load=None, objective=0.0, regret=1.0,
                        violates=False, noisy_violations=0, policy_regret=policy_regret(policy_objective, 0.0))
    value = judge.objective(choice.knobs).objective
    burst = getattr(judge.truth, "burst_failure", None)
    unsafe = bool(burst(judge.scenario, choice.knobs)) if burst is not None and judge.truth.startup(
        judge.scenario, choice.knobs).ok else False
    load = _recheck_load(judge, choice)
    # An unsafe choice is a violation: the first full token-budget burst in production crashes it.
    violates = unsafe or load is None or not judge.holds(choice.knobs, load)
    # The re-check's noise is the world's and the setting's, not the strategy's: two strategies that chose the same
    # setting and load get the same re-check (common random numbers).
    noisy = RECHECK_REPEATS if load is None else judge.noisy_violations(
        choice.knobs, load, repeats=RECHECK_REPEATS, noise=noise,
        seed=derive_seed(seed, judge.scenario.name, getattr(judge.truth, "truth_seed", None), "recheck",
                         choice.knobs.label(), load.kind, repr(load.value)))
    return make_run(
        chosen=choice.knobs.label(),
        chosen_knobs=asdict(choice.knobs),
        claimed_load=load.label() if load else None,
        objective=value,
        regret=regret(oracle.objective, value),
        violates=violates,
        noisy_violations=noisy,
        unsafe=unsafe,
        policy_regret=policy_regret(policy_objective, value),
    )


def _recheck_load(judge: Judge, choice: Choice) -> Load | None:
    """Throughput scenarios: the scenario's load. Capacity: the load the strategy claims its setting holds."""
    if judge.scenario.objective == "throughput":
        return judge.scenario.load
    return choice.claimed_load


def summarize(results: Sequence[ScenarioResult]) -> tuple[StrategySummary, ...]:
    names: list[str] = []
    for result in results:
        for run in result.runs:
            if run.strategy not in names:
                names.append(run.strategy)
    out = []
    for name in names:
        runs = [(r, run) for r in results for run in r.runs if run.strategy == name]
        ratios, chose_ratios = [], []
        for result, run in runs:
            base = next((b for b in result.runs if b.strategy == BASELINE), None)
            if base is not None and base.gpu_minutes > 0:
                ratios.append(run.gpu_minutes / base.gpu_minutes)
                if base.chosen is not None:
                    chose_ratios.append(run.gpu_minutes / base.gpu_minutes)
        regrets = [run.regret for _, run in runs]
        cheaper = None
        if name != REFERENCE:
            pairs = [(run, next((b for b in result.runs if b.strategy == REFERENCE), None)) for result, run in runs]
            cheaper = sum(ref is not None and run.gpu_minutes < ref.gpu_minutes for run, ref in pairs)
        out.append(StrategySummary(
            strategy=name,
            mean_regret=statistics.fmean(regrets) if regrets else 0.0,
            max_regret=max(regrets, default=0.0),
            scenarios_within_regret_target=sum(r <= REGRET_TARGET + 1e-9 for r in regrets),
            violating_choices=sum(run.violates for _, run in runs),
            no_choice=sum(run.chosen is None for _, run in runs),
            median_gpu_minutes_ratio=statistics.median(ratios) if ratios else None,
            median_gpu_minutes_ratio_where_baseline_chose=statistics.median(chose_ratios) if chose_ratios else None,
            total_gpu_minutes=sum(run.gpu_minutes for _, run in runs),
            mean_trials=statistics.fmean(run.trials for _, run in runs) if runs else 0.0,
            within_1pct=sum(r <= 0.01 + 1e-9 for r in regrets), within_3pct=sum(r <= 0.03 + 1e-9 for r in regrets),
            cheaper_than_reference=cheaper,
        ))
    return tuple(out)


def design_checks(scenarios: Sequence[Scenario], results: Sequence[ScenarioResult]) -> tuple[str, ...]:
    """Each case's scenario design against its reality (a check can fail on one reality and hold on another)."""
    failed = []
    by_name = {s.name: s for s in scenarios}
    for result in results:
        scenario = by_name.get(result.scenario)
        if scenario is None:
            continue
        if scenario.expect_best_gmu_below_max and not result.best_gmu_below_max:
            failed.append(f"{result.case}: the oracle's best gmu is not below the largest ({result.oracle_setting})")
        if scenario.expect_preemptions and not result.saturation_preemptions_per_s > 0:
            failed.append(f"{result.case}: no preemptions at the largest batch, so it is not KV-bound")
        if result.oracle_objective <= 0:
            failed.append(f"{result.case}: no setting in the oracle grid meets the SLO")
    return tuple(failed)


def run_bench(
    scenarios: Sequence[Scenario],
    truth_factory: Callable[..., GroundTruth],
    *,
    seed: int = 0,
    noise: float,
    jobs: int = 1,
    use_cache: bool = False,
    progress: Callable[[ScenarioResult], None] | None = None,
    truth_name: str = "nominal",
    truth_seeds: Sequence[int] = (),
    strategies: Callable[[GroundTruth], Sequence[TuningStrategy]] | None = None,
    with_tpe: bool = True,
) -> BenchResult:
    """Every scenario on every reality: `truth_factory(truth_seed=s)` for each of `truth_seeds`, or once
    `truth_factory()` when there are none (a truth without seeds). `strategies`: what runs on a truth (default
    `default_strategies`; a picklable callable where `jobs` > 1)."""
    from batchtune.twin.predict import PredictMemo, memoised

    started = time.monotonic()
    cases: list[tuple[Scenario, int | None]] = [(sc, ts) for sc in scenarios for ts in (tuple(truth_seeds) or (None,))]
    results: list[ScenarioResult] = []
    if jobs <= 1 or len(cases) <= 1:
        truths: dict[int | None, GroundTruth] = {}
        # One memo for the run: a scenario's cases on other realities share its strategies' nominal-twin predictions.
        with memoised(PredictMemo(MEMO_SIMULATIONS)):
            for scenario, truth_seed in cases:
                if truth_seed not in truths:
                    truths[truth_seed] = _truth(truth_factory, truth_seed)
                truth = truths[truth_seed]
                result = run_scenario(scenario, truth, seed=seed, noise=noise, use_cache=use_cache,
                                      truth_seed=truth_seed, strategies=strategies(truth) if strategies else None,
                                      with_tpe=with_tpe)
                results.append(result)
                if progress:
                    progress(result)
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # Longest cases first (each worker takes the next when it is free), so no long case starts last while the
        # other worker idles; the results keep the cases' order whatever order they finish in.
        order = sorted(range(len(cases)), key=lambda i: (-case_cost(cases[i][0]), i))
        done: dict[int, ScenarioResult] = {}
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_run_one, cases[i][0], truth_factory, cases[i][1], seed, noise, use_cache,
                                   strategies, with_tpe): i for i in order}
            for future in as_completed(futures):
                result = future.result()
                done[futures[future]] = result
                if progress:
                    progress(result)
        results = [done[i] for i in range(len(cases))]
    return BenchResult(
        seed=seed, noise=noise, scenarios=tuple(results), summary=summarize(results),
        seconds=time.monotonic() - started, checks=design_checks(scenarios, results), truth=truth_name,
        truth_seeds=tuple(truth_seeds),
    )


def _truth(truth_factory: Callable[..., GroundTruth], truth_seed: int | None) -> GroundTruth:
    return truth_factory() if truth_seed is None else truth_factory(truth_seed=truth_seed)


def case_cost(scenario: Scenario) -> float:
    """A case's relative cost, to start the longest first: its simulated window times the oracle's grid."""
    return scenario.window_s * scenario.oracle_space.size


_worker_memo: Any = None
"""A worker process's memo of simulations, kept across the cases it runs (the process ends with the run's pool)."""


def _run_one(
    scenario: Scenario, truth_factory: Callable[..., GroundTruth], truth_seed: int | None, seed: int, noise: float,
    use_cache: bool, strategies: Callable[[GroundTruth], Sequence[TuningStrategy]] | None, with_tpe: bool,
) -> ScenarioResult:
    from batchtune.twin.predict import PredictMemo, memoised

    global _worker_memo
    if _worker_memo is None:
        _worker_memo = PredictMemo(MEMO_SIMULATIONS)
    truth = _truth(truth_factory, truth_seed)
    with memoised(_worker_memo):
        return run_scenario(scenario, truth, seed=seed, noise=noise, use_cache=use_cache, truth_seed=truth_seed,
                            strategies=strategies(truth) if strategies else None, with_tpe=with_tpe)


def load_result(data: dict[str, Any]) -> BenchResult:
    """A saved result (`--save`) back as a BenchResult, its summary recomputed by this code."""
    scenarios = []
    for sc in data["scenarios"]:
        runs = tuple(StrategyRun(**{**r, "predictions": tuple(r.get("predictions") or ())}) for r in sc["runs"])
        scenarios.append(ScenarioResult(**{**sc, "tags": tuple(sc.get("tags") or ()), "runs": runs,
                                           "noise_bands": tuple(sc.get("noise_bands") or ())}))
    return BenchResult(seed=data["seed"], noise=data["noise"], scenarios=tuple(scenarios),
                       summary=summarize(scenarios), seconds=data["seconds"], checks=tuple(data.get("checks") or ()),
                       truth=data.get("truth", "nominal"), truth_seeds=tuple(data.get("truth_seeds") or ()),
                       development_truth_seeds=tuple(data.get("development_truth_seeds") or DEVELOPMENT_TRUTH_SEEDS))
