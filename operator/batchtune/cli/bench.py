"""`batchtune bench tuning`: tuning quality and GPU cost of our strategies against the baselines."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from batchtune.bench.runner import BenchResult, ScenarioResult
    from batchtune.bench.scenarios import Scenario
    from batchtune.bench.strategies.base import TuningStrategy
    from batchtune.bench.testbed import GroundTruth

    StrategiesFn = Callable[[GroundTruth], Sequence[TuningStrategy]]

REPORTING_SEEDS_HELP = "6-10"
DEVELOPMENT_SEEDS_HELP = "0-5"
"""bench.seeds' sets as the help states them (importing the bench at parser build would slow every command;
tests/unit/test_bench_seeds.py checks they agree)."""
DEFAULT_NOISE = 0.03
"""Run-to-run measurement noise of the twin (relative, per metric family) the strategies face."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="benchmarks: tuning quality and cost against the baselines")
    bench_sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    tuning = bench_sub.add_parser(
        "tuning",
        help="regret, SLO violations, trials and GPU-minutes of each strategy on the twin's scenarios",
        description="Run TwinGuided, Adaptive, Bayesian and the baselines (simulation only, vLLM auto_tune.sh, "
                    "doubling, hill climbing, Optuna TPE) on each scenario against a ground truth (by default each "
                    "scenario's hidden perturbed reality; the strategies only know the nominal twin), and judge their "
                    "choices against an exhaustive noise-free oracle on that truth.",
    )
    tuning.add_argument("--quick", action="store_true", help="the quick subset of scenarios")
    tuning.add_argument("-o", "--output", choices=("table", "json", "markdown"), default="table")
    tuning.add_argument("--seed", type=int, default=0, help="seed of every noisy reading and strategy (default 0)")
    tuning.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    tuning.add_argument("--strategies", default="", metavar="NAMES",
                        help="comma-separated strategies to run, as the results name them (e.g. adaptive,twin_guided; "
                             "default: all). optuna_tpe's trial budget is adaptive's trial count on the scenario when "
                             "adaptive runs too, else 12")
    tuning.add_argument("--noise", type=float, default=DEFAULT_NOISE, help=f"measurement noise (default {DEFAULT_NOISE})")
    tuning.add_argument("--truth", choices=("perturbed", "far", "nominal", "recorded"), default="perturbed",
                        help="what the strategies tune against: each scenario's hidden reality (default: the twin "
                             "with re-drawn parameters and 1-2 structures), a reality farther from the twin (far: "
                             "another step-time parameterisation and 1-3 of 5 other structures), the catalog's twin "
                             "they plan with, or real vLLM on CPU as recorded (its own scenario; readings drawn from "
                             "the recorded repeats; docs/benchmarks.md)")
    tuning.add_argument("--recording", metavar="DIR", default=None,
                        help="--truth recorded: the recording (recording.json and runs/*.json; default the "
                             "repository's tests/data/real-vllm-curve)")
    tuning.add_argument("--truth-seeds", "--truth-seed", default=None, metavar="SEEDS",
                        help="the hidden realities every scenario is judged on, e.g. 1-5 or 1,3 (default "
                             f"{REPORTING_SEEDS_HELP}, held out; {DEVELOPMENT_SEEDS_HELP} is the development set the "
                             "strategies' rules were tuned on, so a result on it is no evidence)")
    tuning.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="scenarios run in parallel processes (default: up to 2)")
    tuning.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse noise-free oracle results under ~/.cache/batchtune/bench (default on)")
    tuning.add_argument("--save", metavar="PATH", help="also write the JSON result to PATH")
    tuning.add_argument("--render", metavar="PATH", help="render a result saved with --save (no run)")
    tuning.add_argument("--list", action="store_true", help="list the scenarios and exit")
    tuning.set_defaults(func=_tuning)

    def print_help(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=print_help)


def _tuning(args: argparse.Namespace) -> int:
    from batchtune.bench.report import to_json
    from batchtune.bench.runner import run_bench

    if args.render:
        return _render(args)
    picked = _pick(args)
    if isinstance(picked, str):
        print(f"error: {picked}", file=sys.stderr)
        return 2
    scenarios, factory, strategies = picked
    only = _only(args.strategies, strategies)
    if isinstance(only, str):
        print(f"error: {only}", file=sys.stderr)
        return 2
    strategies, with_tpe = only
    if args.list:
        for s in scenarios:
            print(f"{s.name:32} {s.model} on {s.tensor_parallel_size}x {s.gpu}, {s.input_len}/{s.output_len} tokens, "
                  f"{s.objective} ({s.objective_unit}), SLO {s.slo.label()}{' [quick]' if s.quick else ''}")
        return 0
    from batchtune.bench.seeds import REPORTING_TRUTH_SEEDS, parse_truth_seeds

    try:
        truth_seeds = (() if args.truth in ("nominal", "recorded") else
                       REPORTING_TRUTH_SEEDS if args.truth_seeds is None else parse_truth_seeds(args.truth_seeds))
    except ValueError as exc:
        print(f"error: --truth-seeds: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.noise < 1:
        print(f"error: --noise {args.noise} must be in [0, 1)", file=sys.stderr)
        return 2

    def progress(result: ScenarioResult) -> None:
        if args.output == "table":
            print(f"Finished {result.case} in {result.seconds:.0f} s", file=sys.stderr)

    result = run_bench(scenarios, factory, seed=args.seed, noise=args.noise, jobs=max(1, args.jobs),
                       use_cache=args.cache, progress=progress, truth_name=args.truth, truth_seeds=truth_seeds,
                       strategies=strategies, with_tpe=with_tpe)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as fh:
            fh.write(to_json(result))
    return _emit(result, args.output)


def _render(args: argparse.Namespace) -> int:
    from batchtune.bench.runner import load_result
    from batchtune.files import InputFileError, expect, read_json
    from batchtune.terminal import safe

    try:
        loaded = load_result(expect(read_json(args.render), dict, args.render))
    except InputFileError as exc:
        print(f"error: --render {safe(exc)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a saved result of another shape
        print(f"error: --render {safe(args.render)}: not a `batchtune bench --save` result "
              f"({type(exc).__name__}: {safe(exc)})", file=sys.stderr)
        return 2
    return _emit(loaded, args.output)


def _pick(args: argparse.Namespace) -> tuple[list[Scenario], Callable[..., GroundTruth], StrategiesFn | None] | str:
    """The scenarios, the truth's factory and the strategies to run (None: the default), or what is wrong."""
    from batchtune.terminal import safe

    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if args.truth != "recorded":
        if args.recording is not None:
            return "--recording needs --truth recorded"
        from batchtune.bench.reality import PerturbedTruth
        from batchtune.bench.scenarios import get_scenarios
        from batchtune.bench.twin_truth import TwinTruth

        try:
            scenarios = get_scenarios(names or None, quick=args.quick)
        except ValueError as exc:
            return f"--scenarios: {exc}"
        from batchtune.bench.far_reality import FarTruth

        return scenarios, {"nominal": TwinTruth, "perturbed": PerturbedTruth, "far": FarTruth}[args.truth], None
    from functools import partial

    from batchtune.bench.recorded import DEFAULT_RECORDING, RecordedTruth, get_recorded_scenarios, recorded_strategies

    # The recording's own scenario(s): its settings and loads only, so nothing to quicken (--quick is moot).
    directory = args.recording or str(DEFAULT_RECORDING)
    try:
        scenarios = get_recorded_scenarios(names or None, directory)
    except (ValueError, OSError, KeyError) as exc:
        return f"--truth recorded: {safe(exc)}"
    return scenarios, partial(RecordedTruth, directory), recorded_strategies


def _only(value: str, strategies: StrategiesFn | None) -> tuple[StrategiesFn | None, bool] | str:
    """`--strategies`: the strategies to run and whether Optuna TPE is one of them, or what is wrong."""
    from batchtune.bench.runner import STRATEGY_NAMES, TPE_NAME, OnlyStrategies
    from batchtune.terminal import safe

    if not value:
        return strategies, True
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGY_NAMES]
    if unknown or not names:
        return (f"--strategies {safe(value)!r}: unknown strategy {', '.join(map(repr, map(safe, unknown)))} "
                if unknown else f"--strategies {safe(value)!r}: no strategy named ") + \
            f"(known: {', '.join(STRATEGY_NAMES)})"
    return OnlyStrategies(frozenset(names), strategies), TPE_NAME in names


def _emit(result: BenchResult, output: str) -> int:
    from batchtune.bench.report import markdown, print_tables, to_json

    if output == "json":
        print(to_json(result))
    elif output == "markdown":
        print(markdown(result))
    else:
        print_tables(result)
    return 0
