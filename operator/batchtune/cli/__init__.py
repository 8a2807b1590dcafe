"""The `batchtune` command line: one module per subcommand, each with `add_parser(subparsers)`.

Subcommand modules import their heavy dependencies inside the handler, so `batchtune --help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
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
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
