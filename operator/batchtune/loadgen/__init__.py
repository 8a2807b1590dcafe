"""The load generator: streaming OpenAI-API load with `vllm bench serve`-compatible results.

Public API: `LoadRun`, `run_load` (async), `run_load_sync`, `check_target`, `TargetRefused`,
`compute_result`, `compact_summary`, `format_report`, and the prompt helpers in `prompts`.
"""

from batchtune.loadgen.runner import (
    LoadRun,
    TargetRefused,
    check_target,
    format_report,
    run_load,
    run_load_sync,
)
from batchtune.loadgen.stats import ClientWindow, RequestRecord, censored_quantile, compact_summary, compute_result

__all__ = [
    "LoadRun",
    "RequestRecord",
    "TargetRefused",
    "ClientWindow",
    "check_target",
    "compact_summary",
    "censored_quantile",
    "compute_result",
    "format_report",
    "run_load",
    "run_load_sync",
]
