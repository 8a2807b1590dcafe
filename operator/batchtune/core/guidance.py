"""The twin's advice as the search reads it (pure); twin/guide.py computes it, controller/guidance.py asks for it.

The twin (`batchtune.twin.guide`) computes a `TwinAdvice` off the reconcile path from the finished
trials; the `TwinGuided` strategy reads it as plain data, so a restarted operator rebuilding the
strategy from status asks the same. `basis` names the trials an advice was calibrated on: an advice
whose basis is not the history's own is stale and must be recomputed before the strategy is asked.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from batchtune.core.outcomes import HistoryEntry
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import M, TrialState

KEPT_PREDICTIONS = 20
"""How many of the best predictions status keeps (the strategy looks no further in practice)."""
# A prediction misses a measurement when a figure is off by more than its family's share.
PREDICTION_TOLERANCE: Mapping[str, float] = MappingProxyType({
    "throughput": 0.10, "itl": 0.15, "tpot": 0.15, "ttft": 0.30, "e2el": 0.20, "running": 0.20,
})
MARGIN_TOLERANCE = 0.15
"""A latency under an SLO target misses when predicted and measured differ by more than this share of the
target's limit: what decides is how far from the limit a figure sits, not how far 80 ms is from 120 ms under
a 2 s target (nor a p95 ITL that jumps with the share of prompt-carrying steps while both stay far below)."""
LATENCY_FAMILIES = frozenset({"itl", "tpot", "ttft", "e2el"})
# Status metric -> tolerance family.
FAMILY: Mapping[str, str] = MappingProxyType({
    M.REQUEST_THROUGHPUT: "throughput", M.OUTPUT_THROUGHPUT: "throughput", M.ITL_MS: "itl", M.TTFT_MS: "ttft",
    M.E2E_MS: "e2el", M.RUNNING_REQUESTS: "running", M.ITL_MEAN_MS: "itl", M.TTFT_MEAN_MS: "ttft",
})


@dataclass(frozen=True)
class Predicted:
    """The twin's prediction for one candidate."""

    setting: Setting
    objective: float
    """Predicted objective (the objective's unit); 0 when the setting cannot serve (or would not start)."""
    capacity_load: int | None = None
    """The load (the protocol's unit: concurrent requests, or requests per minute) the objective is at."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Status metric keys predicted at `capacity_load` (latencies at the SLO percentile)."""
    simulated: bool = False
    """True when the event simulation confirmed it (else the fast path's estimate)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))


@dataclass(frozen=True)
class Agreement:
    """A launched trial's first step against what was predicted for it."""

    agrees: bool
    worst: str
    """The figure furthest from its prediction, relative to its tolerance, in words."""


@dataclass(frozen=True)
class TwinAdvice:
    """The calibrated twin's view of the plan, for one basis (the trials it was calibrated on)."""

    basis: str
    available: bool = True
    """False: no twin for this deployment (unknown engine, model or GPU, or an objective it cannot predict)."""
    trusted: bool = True
    """The calibration's verdict: every residual within `PREDICTION_TOLERANCE`."""
    reason: str = ""
    calibration_setting: Setting | None = None
    """Where to measure first: the nominal twin's best candidate (its capacity search spans the loads that matter)."""
    ranked: tuple[Predicted, ...] = ()
    """Candidates that fit and hold their SLO somewhere, best first."""
    agreements: Mapping[Setting, Agreement] = field(default_factory=dict)
    """For every measured trial that was launched on a prediction: did its first step agree?"""
    seconds: float = 0.0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "agreements", MappingProxyType(dict(self.agreements)))

    def predicted(self, setting: Setting) -> Predicted | None:
        return next((p for p in self.ranked if p.setting == setting), None)


def truncated(advice: TwinAdvice, keep: Sequence[Setting], top: int = KEPT_PREDICTIONS) -> TwinAdvice:
    """The advice with its `top` best predictions and those of the `keep` settings (the measured ones, which
    the strategy compares against): what status holds, so what every ask sees, in the operator and the bench."""
    wanted = set(keep)
    ranked = tuple(p for i, p in enumerate(advice.ranked) if i < top or p.setting in wanted)
    return TwinAdvice(advice.basis, advice.available, advice.trusted, advice.reason, advice.calibration_setting,
                      ranked, advice.agreements, advice.seconds, advice.notes)


def measured(history: Sequence[HistoryEntry]) -> list[HistoryEntry]:
    """The trials that ran load (Done): what a calibration can learn from."""
    return [(s, o) for s, o in history if o.state is TrialState.DONE and o.steps]


def advice_basis(history: Sequence[HistoryEntry]) -> str:
    """A fingerprint of the measured trials: settings, step loads and figures (rounded), in trial order."""
    items = []
    for setting, outcome in measured(history):
        steps = [[s.load, sorted((k, round(v, 3)) for k, v in s.metrics.items() if math.isfinite(v))]
                 for s in outcome.steps]
        items.append([setting.label(), steps])
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


def agreement(predicted: Mapping[str, float], measured_metrics: Mapping[str, float],
              limits: Mapping[str, float] | None = None) -> Agreement:
    """Does a measurement agree with its prediction? Throughput and running batch within their share; with
    `limits` (status metric -> the SLO limit, headroom applied), each latency under a target within
    `MARGIN_TOLERANCE` of its limit, and latencies without a target do not decide; without, every latency
    within its family's share."""
    worst_ratio, worst = 0.0, "nothing to compare"
    agrees = True
    for key, family in FAMILY.items():
        p, m = predicted.get(key), measured_metrics.get(key)
        if p is None or m is None or not (math.isfinite(p) and math.isfinite(m)) or m <= 0:
            continue
        limit = (limits or {}).get(key)
        if family in LATENCY_FAMILIES and limits is not None:
            if not limit:
                continue
            error, tolerance, unit = (p - m) / limit, MARGIN_TOLERANCE, " of the limit"
        else:
            error, tolerance, unit = (p / m - 1 if p > 0 else -1.0), PREDICTION_TOLERANCE[family], ""
        ratio = abs(error) / tolerance
        if ratio > 1:
            agrees = False
        if ratio >= worst_ratio:
            worst_ratio = ratio
            worst = f"{key}: predicted {p:.4g}, measured {m:.4g} ({error:+.0%}{unit}, tolerance {tolerance:.0%})"
    return Agreement(agrees, worst)
