"""The load generator as a command: the time scale from the environment, number lists, and one run with its result
file and termination summary; shared by `batchtune loadgen` (cli/loadgen.py) and the twin's `vllm bench serve`
(twin/cli_vllm.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

TERMINATION_ENV = "BATCHTUNE_TERMINATION_MESSAGE_PATH"
TIME_SCALE_ENV = "BATCHTUNE_TIME_SCALE"


def env_time_scale() -> float:
    """BATCHTUNE_TIME_SCALE as a float (1 when unset or empty)."""
    raw = os.environ.get(TIME_SCALE_ENV, "").strip()
    try:
        value = float(raw) if raw else 1.0
    except ValueError:
        raise SystemExit(f"error: {TIME_SCALE_ENV}={raw!r} is not a number") from None
    if value <= 0:
        raise SystemExit(f"error: {TIME_SCALE_ENV}={raw!r} must be > 0")
    return value


def parse_floats(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}={text!r}: expected comma-separated numbers") from None


def execute(spec: Any, *, result_file: str | None, termination_path: str | None, quiet: bool = False) -> int:
    """Run `spec`, write the result file and termination summary; exit 0 if any request completed."""
    import json

    from batchtune.loadgen import TargetRefused, compact_summary, format_report, run_load_sync

    # A node agent standing in for the kubelet names where the container's message file really is.
    termination = os.environ.get(TERMINATION_ENV) or termination_path or None

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        result = run_load_sync(spec, log=log)
    except (TargetRefused, ConnectionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if termination:
            write_file(termination, json.dumps({"error": str(exc)[:3500]}))
        return 2
    if not quiet:
        print(format_report(result), flush=True)
    if result_file:
        write_file(result_file, json.dumps(result, indent=2))
    if termination:
        write_file(termination, compact_summary(result))
    if not result.get("samples"):
        # Nothing was sent inside the window: no figure can stand. An overloaded run (requests sent,
        # none finished) is a measurement, not a failure: its percentiles say how slow it was.
        print("error: no request was sent inside the measurement window", file=sys.stderr)
        return 1
    return 0


def write_file(path: str, text: str) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
