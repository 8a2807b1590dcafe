"""The `batchtune` command line: one module per subcommand, each with `add_parser(subparsers)`.

Subcommand modules import their heavy dependencies inside the handler, so `batchtune --help`
stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from batchtune import __version__

# Order is the order shown in --help. Modules are named, not imported: `batchtune operator` is the operator's own
# entry point (controller/main.py), which the CLI never imports otherwise (the layering in pyproject.toml).
COMMAND_MODULES = [
    "batchtune.cli.validate",
    "batchtune.cli.plan",
    "batchtune.cli.twin",
    "batchtune.cli.loadgen",
    "batchtune.controller.main",
    "batchtune.cli.status",
    "batchtune.cli.report",
    "batchtune.cli.recommend",
    "batchtune.cli.workload",
    "batchtune.cli.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchtune",
        description="Tune vLLM batching settings against latency SLOs.",
    )
    parser.add_argument("--version", action="version", version=f"batchtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not getattr(args, "vllm_flags", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra = extra  # a subcommand that reads `vllm serve` flags (twin calibrate) parses them itself
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    if argv is None and getattr(args, "exit_when_done", False):
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End this process without the interpreter's teardown: a command whose result is a file read once the process
    has ended (the load generator's summary) is done when the file is written, and the teardown costs 0.15 s of CPU,
    seconds on a node whose CPUs the trial pods share."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe has nothing left to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
