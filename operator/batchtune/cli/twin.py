"""`batchtune twin ...`: the vLLM + GPU twin (predict, serve, and the `vllm` stand-in entry point)."""

from __future__ import annotations

import argparse
import importlib

# Each module exposes add_parser(twin_subparsers).
TWIN_COMMAND_MODULES = [
    "batchtune.twin.cli_predict",
    "batchtune.twin.cli_calibrate",
    "batchtune.twin.cli_serve",
    "batchtune.twin.cli_vllm",
]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("twin", help="simulated vLLM on a GPU: what-if predictions and a stand-in server")
    twin_sub = parser.add_subparsers(dest="twin_command", metavar="TWIN_COMMAND")
    for name in TWIN_COMMAND_MODULES:
        importlib.import_module(name).add_parser(twin_sub)

    def print_help(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=print_help)
