"""Objective values (all maximised) from a trial's status metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from batchtune.core.vocabulary import M


class Objective(StrEnum):
    SLO_CAPACITY = "SloCapacity"
    OUTPUT_THROUGHPUT = "OutputThroughput"
    GPU_UTILIZATION = "GpuUtilization"
    TOKENS_PER_JOULE = "TokensPerJoule"
    GOODPUT = "Goodput"

    @property
    def searches_capacity(self) -> bool:
        """Whether a trial searches the highest load it holds within the SLO (else: one step at a fixed load)."""
        return self in (Objective.SLO_CAPACITY, Objective.GOODPUT)


OBJECTIVE_UNITS = {
    Objective.SLO_CAPACITY: "req/s",
    Objective.OUTPUT_THROUGHPUT: "tok/s",
    Objective.GPU_UTILIZATION: "%",
    Objective.TOKENS_PER_JOULE: "tok/J",
    Objective.GOODPUT: "req/s",
}


def _get(metrics: Mapping[str, Any], name: str) -> float | None:
    value = metrics.get(name)
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def objective_value(objective: Objective | str, metrics: Mapping[str, Any]) -> float | None:
    """The objective from status metrics, or None when what it needs was not measured.

    SloCapacity: `sloCapacity` (highest load sustained within the SLO), else the request throughput
    the trial sustained. GpuUtilization: SM active when exported (GPU_UTIL is near 100% whenever any
    kernel runs), else GPU_UTIL. TokensPerJoule: output tokens/s over watts. Goodput: the requests per
    second that met every SLO target each (TTFT, time per output token, end-to-end) at the trial's SLO
    capacity under production's shape; never taken from a throughput (unmeasured is unknown).
    """
    objective = Objective(objective)
    if objective is Objective.GOODPUT:
        return _get(metrics, M.GOODPUT)
    if objective is Objective.SLO_CAPACITY:
        value = _get(metrics, M.SLO_CAPACITY)
        return value if value is not None else _get(metrics, M.REQUEST_THROUGHPUT)
    if objective is Objective.OUTPUT_THROUGHPUT:
        return _get(metrics, M.OUTPUT_THROUGHPUT)
    if objective is Objective.GPU_UTILIZATION:
        value = _get(metrics, M.SM_ACTIVE_PERCENT)
        return value if value is not None else _get(metrics, M.GPU_UTIL_PERCENT)
    throughput, watts = _get(metrics, M.OUTPUT_THROUGHPUT), _get(metrics, M.POWER_WATTS)
    if throughput is None or watts is None or watts <= 0:
        return None
    return throughput / watts
