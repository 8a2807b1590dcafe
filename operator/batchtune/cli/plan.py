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
    from batchtune.core import EngineLimits, Setting
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


def run(args: argparse.Namespace) -> int:  # noqa: C901
    from rich.console import Console
    from rich.table import Table

    from batchtune import __version__
    from batchtune.admission import review
    from batchtune.api import InvalidBatchTuning, load_file
    from batchtune.core import EngineLimits, plan_candidates
    from batchtune.core.install import install_from_values
    from batchtune.core.search import Search
    from batchtune.engines import VLLM, ArgsError
    from batchtune.files import InputFileError

    console = Console(highlight=False)
    status = 0
    if args.gpu and not args.target:
        print("--gpu needs --target: the memory prefilter sizes the target's model, parallelism and quantization",
              file=sys.stderr)
        return 1
    for name in args.files:
        try:
            tunings = load_file(name)
        except OSError as exc:
            print(f"{safe(name)}: cannot read: {safe(exc.strerror or exc)}", file=sys.stderr)
            status = 1
            continue
        except InvalidBatchTuning as exc:
            for error in exc.errors:
                print(f"{safe(exc.source or name)}: {error}")
            status = 1
            continue
        if not tunings:
            print(f"{safe(name)}: no BatchTuning found", file=sys.stderr)
            status = 1
        for bt in tunings:
            spec = bt.spec
            title = safe(f"{name}: {bt.metadata.namespace + '/' if bt.metadata.namespace else ''}{bt.metadata.name}")
            engine: Engine = VLLM
            limits = EngineLimits()
            if args.target:
                try:
                    engine, limits, invocation = _target(args.target, spec.target_ref.container_name)
                except InputFileError as exc:
                    print(safe(exc))
                    status = 1
                    continue
                except ArgsError as exc:
                    print(f"{safe(args.target)}: {safe(exc)}")
                    status = 1
                    continue
                console.print(f"[bold]{markup(title)}[/]: baseline {markup(invocation.model or '?')} "
                              f"max-num-seqs={markup(invocation.max_num_seqs)} "
                              f"gmu={markup(invocation.gpu_memory_utilization_percent)}% "
                              f"mbt={markup(invocation.max_num_batched_tokens)}")
            try:
                space = spec.search_space.core()
            except ValueError as exc:
                print(f"{title}: spec.searchSpace: {safe(exc)}")
                status = 1
                continue
            # The operator's own check (batchtune.admission), against the chart's default install.
            problems = review(engine, spec, install_from_values({}, __version__), None).invalid
            if problems:
                for problem in problems:
                    print(f"{title}: {safe(problem)}")
                status = 1
                continue
            # The extra args come last on every trial's command line, so their limits win (as validate reads them).
            limits = engine.limits(invocation.flags if args.target else {}, spec.search_space.extra_args or [])

            def invariant(setting: Setting, engine: Engine = engine, limits: EngineLimits = limits) -> str | None:
                return engine.invariant_violation(setting, limits)

            fits = None
            if args.gpu:
                from batchtune.twin.catalog import UnknownGpu, gpu_from_product_label
                from batchtune.twin.prefilter import memory_fit

                try:
                    gpu_from_product_label(args.gpu)
                except UnknownGpu as exc:
                    print(f"--gpu: {safe(exc)}", file=sys.stderr)
                    return 1
                fits, prefilter_note = memory_fit(engine, invocation, args.gpu)
                console.print(text(f"{prefilter_note} (--gpu {args.gpu})"))
            plan = plan_candidates(space, invariant, fits, limits=limits)
            extra = list(spec.search_space.extra_args or [])
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
            if plan.error:
                print(f"{title}: {safe(plan.error)}")
                status = 1
                continue
            strategy_kind = getattr(spec.strategy.type, "value", spec.strategy.type)
            search = Search.start(strategy_kind, space, invariant, plan.pruned, spec.slo.core(),
                                  getattr(spec.objective.type, "value", spec.objective.type),
                                  spec.strategy.seed, spec.strategy.max_trials)
            wanted = args.asks if args.asks is not None else max(3, spec.strategy.max_parallel_trials)
            asks: list[Setting] = []
            for _ in range(wanted):
                ask = search.ask([], pending=asks)
                if ask is None:
                    break
                asks.append(ask)
            budget = min(spec.strategy.max_trials, len(plan.candidates))
            console.print(text(
                f"strategy {strategy_kind} (seed {spec.strategy.seed}, at most {budget} trial(s)); "
                f"first asks: " + (", ".join(s.label() for s in asks) or "none")
            ))
    return status
