"""The load generator: streaming OpenAI-API load with `vllm bench serve`-compatible results.

Public API: `LoadRun`, `run_load` (async), `run_load_sync`, `check_target`, `TargetRefused`,
`compute_result`, `compact_summary`, `format_report`, and the prompt helpers in `prompts`.

The names load on first use (PEP 562): `batchtune loadgen`'s argument parser is built in every `batchtune`
process, the operator's included, and the runner's statistics pull in numpy (~14 MB of RSS) that only a
load run needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchtune.loadgen.runner import (
        LoadRun,
        TargetRefused,
        check_target,
        format_report,
        run_load,
        run_load_sync,
    )
    from batchtune.loadgen.stats import (
        ClientWindow,
        RequestRecord,
        censored_quantile,
        censored_quantiles,
        compact_summary,
        compute_result,
    )

_WHERE = {
    "LoadRun": "runner", "TargetRefused": "runner", "check_target": "runner", "format_report": "runner",
    "run_load": "runner", "run_load_sync": "runner",
    "ClientWindow": "stats", "RequestRecord": "stats", "censored_quantile": "stats", "censored_quantiles": "stats",
    "compact_summary": "stats", "compute_result": "stats",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'batchtune.loadgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"batchtune.loadgen.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "LoadRun",
    "RequestRecord",
    "TargetRefused",
    "ClientWindow",
    "check_target",
    "compact_summary",
    "censored_quantile",
    "censored_quantiles",
    "compute_result",
    "format_report",
    "run_load",
    "run_load_sync",
]
