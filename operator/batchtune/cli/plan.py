"""`batchtune plan -f FILE`: the candidate settings a BatchTuning would try, what is pruned and why,
and the strategy's first asks, offline (no cluster).

Give `--target DEPLOYMENT.yaml` to read the production container's vLLM flags (max-model-len,
chunked prefill, its own max-num-batched-tokens) as a running operator would, and `--gpu PRODUCT` (the
nodes' `nvidia.com/gpu.product` label, or a twin catalog name) to run the operator's memory prefilter
(`twin.prefilter.memory_fit`): the settings it would prune before anything runs, with vLLM's reason.
Exit 0 with a plan, 1 on invalid input, an unknown GPU or an empty plan.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, cast

from batchtune.terminal import markup, safe, text

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from batchtune.api import BatchTuning
    from batchtune.core import EngineLimits, Setting
    from batchtune.core.planning import Plan, SearchSpace
    from batchtune.engines import Engine, Invocation


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "plan",
        help="print the planned trial settings, what is pruned and why (offline)",
        description="Plan the trials of BatchTuning YAML files without a cluster.",
    )
    parser.add_argument("-f", "--filename", dest="files", action="append", required=True, metavar="FILE",
                        help="a YAML file with one or more BatchTunings; repeatable")
    parser.add_argument("--target", metavar="FILE", default=None,
                        help="the target Deployment as YAML, to take engine limits from its vLLM flags")
    parser.add_argument("--gpu", metavar="PRODUCT", default=None,
                        help="the GPU (nvidia.com/gpu.product label or catalog name): prune what does not fit its "
                             "memory, as the operator's prefilter does (needs --target for the model)")
    parser.add_argument("--asks", type=int, default=None, metavar="N",
                        help="how many first asks to show (default: maxParallelTrials, at least 3)")
    parser.set_defaults(func=run)


def _pod_spec(deployment: dict[str, Any], path: str) -> dict[str, Any]:
    """The Deployment's pod template spec, its containers checked to be what the engine adapter reads."""
    from batchtune.files import expect

    spec = expect(deployment.get("spec", {}), dict, path, "spec")
    template = expect(spec.get("template", {}), dict, path, "spec.template")
    pod_spec = expect(template.get("spec", {}), dict, path, "spec.template.spec")
    containers = expect(pod_spec.get("containers", []), list, path, "spec.template.spec.containers")
    for i, container in enumerate(containers):
        where = f"spec.template.spec.containers[{i}]"
        expect(container, dict, path, where)
        expect(container.get("name", ""), str, path, f"{where}.name")
        for key in ("command", "args"):
            for j, arg in enumerate(expect(container.get(key, []), list, path, f"{where}.{key}")):
                expect(arg, str, path, f"{where}.{key}[{j}]")
    return cast(dict[str, Any], pod_spec)


def _target(path: str, container_name: str | None) -> tuple[Engine, EngineLimits, Invocation]:
    """The target Deployment's engine, limits and invocation; InputFileError or ArgsError naming the file."""
    from batchtune.engines import find_engine_container
    from batchtune.files import read_manifest

    pod_spec = _pod_spec(read_manifest(path, "Deployment"), path)
    engine, container = find_engine_container(pod_spec, container_name)
    invocation = engine.read(container)
    return engine, engine.limits(invocation.flags), invocation


class _UnknownGpu(Exception):
    """--gpu names no GPU the twin knows: every plan would be wrong, so `run` stops (said once)."""


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(highlight=False)
    if args.gpu and not args.target:
        print("--gpu needs --target: the memory prefilter sizes the target's model, parallelism and quantization",
              file=sys.stderr)
        return 1
    status = 0
    for name in args.files:
        tunings = _tunings(name)
        if not tunings:
            status = 1
        for bt in tunings or []:
            try:
                if not _plan(args, console, name, bt):
                    status = 1
            except _UnknownGpu:
                return 1
    return status


def _tunings(name: str) -> list[BatchTuning] | None:
    """The BatchTunings of one file; None (errors printed) when it cannot be read, [] (said so) when it has none."""
    from batchtune.api import InvalidBatchTuning, load_file

    try:
        tunings = load_file(name)
    except OSError as exc:
        print(f"{safe(name)}: cannot read: {safe(exc.strerror or exc)}", file=sys.stderr)
        return None
    except InvalidBatchTuning as exc:
        for error in exc.errors:
            print(f"{safe(exc.source or name)}: {error}")
        return None
    if not tunings:
        print(f"{safe(name)}: no BatchTuning found", file=sys.stderr)
    return tunings


def _plan(args: argparse.Namespace, console: Console, name: str, bt: BatchTuning) -> bool:
    """Prints one BatchTuning's plan and first asks; False (why printed) when it cannot be planned."""
    from batchtune import __version__
    from batchtune.admission import review
    from batchtune.core import plan_candidates
    from batchtune.core.install import install_from_values
    from batchtune.engines import VLLM

    spec = bt.spec
    title = safe(f"{name}: {bt.metadata.namespace + '/' if bt.metadata.namespace else ''}{bt.metadata.name}")
    engine: Engine = VLLM
    invocation = None
    if args.target:
        baseline = _baseline(args.target, spec.target_ref.container_name, console, title)
        if baseline is None:
            return False
        engine, invocation = baseline
    try:
        space = spec.search_space.core()
    except ValueError as exc:
        print(f"{title}: spec.searchSpace: {safe(exc)}")
        return False
    # The operator's own check (batchtune.admission), against the chart's default install.
    problems = review(engine, spec, install_from_values({}, __version__), None).invalid
    if problems:
        for problem in problems:
            print(f"{title}: {safe(problem)}")
        return False
    # The extra args come last on every trial's command line, so their limits win (as validate reads them).
    limits = engine.limits(invocation.flags if invocation else {}, spec.search_space.extra_args or [])

    def invariant(setting: Setting, engine: Engine = engine, limits: EngineLimits = limits) -> str | None:
        return engine.invariant_violation(setting, limits)

    fits = _memory_prefilter(args.gpu, engine, invocation, console) if args.gpu and invocation else None
    plan = plan_candidates(space, invariant, fits, limits=limits)
    _print_plan(console, title, engine, plan, list(spec.search_space.extra_args or []))
    if plan.error:
        print(f"{title}: {safe(plan.error)}")
        return False
    _print_first_asks(console, args.asks, bt, space, invariant, plan, len(plan.candidates))
    return True


def _baseline(target: str, container_name: str | None, console: Console,
              title: str) -> tuple[Engine, Invocation] | None:
    """--target's engine and command line, printed; None (why printed) when it cannot be read."""
    from batchtune.engines import ArgsError
    from batchtune.files import InputFileError

    try:
        engine, _, invocation = _target(target, container_name)
    except InputFileError as exc:
        print(safe(exc))
        return None
    except ArgsError as exc:
        print(f"{safe(target)}: {safe(exc)}")
        return None
    console.print(f"[bold]{markup(title)}[/]: baseline {markup(invocation.model or '?')} "
                  f"max-num-seqs={markup(invocation.max_num_seqs)} "
                  f"gmu={markup(invocation.gpu_memory_utilization_percent)}% "
                  f"mbt={markup(invocation.max_num_batched_tokens)}")
    return engine, invocation


def _memory_prefilter(gpu: str, engine: Engine, invocation: Invocation, console: Console) -> Any:
    """The twin's memory fit for --gpu, its note printed; _UnknownGpu (said) for a GPU the twin does not know."""
    from batchtune.twin.catalog import UnknownGpu, gpu_from_product_label
    from batchtune.twin.prefilter import memory_fit

    try:
        gpu_from_product_label(gpu)
    except UnknownGpu as exc:
        print(f"--gpu: {safe(exc)}", file=sys.stderr)
        raise _UnknownGpu from exc
    fits, prefilter_note = memory_fit(engine, invocation, gpu)
    console.print(text(f"{prefilter_note} (--gpu {gpu})"))
    return fits


def _print_plan(console: Console, title: str, engine: Engine, plan: Plan, extra: list[str]) -> None:
    """The candidates with their command-line args, what is pruned and why, and the plan's notes."""
    from rich.table import Table

    table = Table(title=text(f"{title}: {len(plan.candidates)} candidate(s)"))
    table.add_column("#", justify="right")
    table.add_column("setting")
    table.add_column(f"{engine.display} args")
    for i, setting in enumerate(plan.candidates):
        table.add_row(str(i), text(setting.label()), text(" ".join(engine.setting_args(setting) + extra)))
    console.print(table)
    if plan.pruned:
        pruned = Table(title=f"pruned: {len(plan.pruned)}")
        pruned.add_column("setting")
        pruned.add_column("reason")
        for p in plan.pruned:
            pruned.add_row(text(p.setting.label()), text(f"{p.reason.value}: {p.message}"))
        console.print(pruned)
    for note in plan.notes:
        console.print(text(f"note: {note}"))


def _print_first_asks(console: Console, asks_wanted: int | None, bt: BatchTuning, space: SearchSpace,
                      invariant: Callable[[Setting], str | None], plan: Plan, candidates: int) -> None:
    """The strategy's first asks from an empty history, as the operator's first tick would make them."""
    from batchtune.core.search import Search

    spec = bt.spec
    strategy_kind = getattr(spec.strategy.type, "value", spec.strategy.type)
    search = Search.start(strategy_kind, space, invariant, plan.pruned, spec.slo.core(),
                          getattr(spec.objective.type, "value", spec.objective.type),
                          spec.strategy.seed, spec.strategy.max_trials)
    wanted = asks_wanted if asks_wanted is not None else max(3, spec.strategy.max_parallel_trials)
    asks: list[Setting] = []
    for _ in range(wanted):
        ask = search.ask([], pending=asks)
        if ask is None:
            break
        asks.append(ask)
    budget = min(spec.strategy.max_trials, candidates)
    console.print(text(
        f"strategy {strategy_kind} (seed {spec.strategy.seed}, at most {budget} trial(s)); "
        f"first asks: " + (", ".join(s.label() for s in asks) or "none")
    ))
