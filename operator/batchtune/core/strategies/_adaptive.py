"""Adaptive: bracket and bisect max-num-seqs per (gmu, mbt) column, then refine around the knee.

Latency grows with max-num-seqs, so within a column the SLO verdict is Met up to a boundary and
Violated past it: bisection finds the largest SLO-meeting setting in about log2(n) trials.
The exception is a batch too small for its load: when only the latencies that include the queue fail (TTFT,
E2E) while requests wait and the KV cache is not what holds them back, the violation is a lower bound (more seqs
admit the waiting requests), and bisection goes up; an E2E-only SLO misses this way at a small batch under a high
concurrency.
What the history proves is skipped:
- larger max-num-seqs than one that violated the SLO (dominated);
- settings that need at least the memory of one that failed with a memory error: more seqs, at the
  same or LOWER gmu and same or larger mbt (lower gmu leaves less memory, so it fails too);
- every gmu at or above one where vLLM found less free memory than the gmu asks for;
- every setting a failed full token-budget burst rules out (`core.burst`): its column, and those at a higher gmu with
  the same or larger token budget;
- a higher gmu column when the lower one was not KV-bound at its boundary (no preemptions, KV
  usage under 90%, judged on the peak over every load step of the trial, not only the passing step
  the trial's metrics come from): more KV cache would not change its latency;
- with a capacity objective, larger max-num-seqs than a trial that met the SLO KV-bound while its batch never
  filled (`batch_never_filled`: mean running requests under 90% of its max-num-seqs at every failing load step):
  the KV cache, not the batch limit, held its load back, so a larger limit admits nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from batchtune.core.burst import burst_excluded
from batchtune.core.knee import curve_point, find_knee
from batchtune.core.objective import objective_value
from batchtune.core.outcomes import MEMORY_REASONS, History, HistoryEntry, TrialOutcome, TrialState, Verdict
from batchtune.core.planning import PrunedSetting
from batchtune.core.settings import Setting
from batchtune.core.slo import METRIC_E2E_MS, METRIC_TTFT_MS, SloTargets
from batchtune.core.strategies._base import Strategy
from batchtune.core.vocabulary import M, Reason

KV_BOUND_USAGE_PERCENT = 90.0
"""KV-cache usage at or above this (or any preemption) means more GPU memory could help."""
BATCH_FILLED_FRACTION = 0.9
"""A batch whose mean running requests reach this fraction of max-num-seqs filled (`batch_never_filled`)."""

# Peak KV usage / preemption rate over all of a trial's load steps (the operator's trial metrics);
# with the SLO-capacity objective the plain metrics are the passing step's, below where KV binds.
KV_USAGE_METRICS = (M.KV_CACHE_USAGE_PEAK_PERCENT, M.KV_CACHE_USAGE_MAX_PERCENT, M.KV_CACHE_USAGE_PERCENT)
PREEMPTION_METRICS = (M.PREEMPTIONS_PEAK_PER_SECOND, M.PREEMPTIONS_PER_SECOND)
WAITING_METRIC = M.WAITING_REQUESTS

Column = tuple[int, int | None]


class _Kind(Enum):
    MET = "met"
    VIOLATED = "violated"  # SLO violated, or too big for memory: an upper bound on max-num-seqs
    TOO_SMALL = "too_small"  # only queue latencies failed while requests waited: a lower bound on max-num-seqs
    NOINFO = "noinfo"  # unknown verdict or an unrelated failure: says nothing about the boundary


def _peak(outcome: TrialOutcome, names: tuple[str, ...]) -> float | None:
    values = [v for name in names if (v := outcome.metric(name)) is not None]
    return max(values) if values else None


QUEUE_SENSITIVE_TARGETS = frozenset({METRIC_TTFT_MS, METRIC_E2E_MS})
"""Latency targets a request's wait in the queue adds to; ITL is per generated token and excludes it."""


def queued_miss(outcome: TrialOutcome, slo: SloTargets) -> bool:
    """Whether a violation is the queue's: the batch is too small for the load, a lower bound on max-num-seqs.

    Requests waited, every failing target is one the queue adds to (TTFT, E2E), and every other latency target is
    measured and within its limit (a batch also too slow per token, ITL, stays an upper bound). The wait must be
    the batch's, not the KV cache's: with preemptions or the KV cache nearly full, more seqs admit nothing."""
    targets = slo.latency_targets()
    waiting = outcome.metric(WAITING_METRIC)
    if not QUEUE_SENSITIVE_TARGETS & targets.keys() or waiting is None or not waiting > 0:
        return False
    preemptions = _peak(outcome, PREEMPTION_METRICS)
    usage = _peak(outcome, KV_USAGE_METRICS)
    if (preemptions is not None and preemptions > 0) or (usage is not None and usage >= KV_BOUND_USAGE_PERCENT):
        return False
    over = []
    for metric, target in targets.items():
        value = outcome.metric(metric)
        if value is None:
            return False
        if value > slo.limit(target):
            if metric not in QUEUE_SENSITIVE_TARGETS:
                return False
            over.append(metric)
    return bool(over)


def _kv_evidence(outcome: TrialOutcome) -> str | None:
    """Why the trial was KV-bound (a preemption, or peak KV usage at or above 90%), or None."""
    preemptions = _peak(outcome, PREEMPTION_METRICS)
    if preemptions is not None and preemptions > 0:
        return f"preemptions {preemptions:g}/s"
    usage = _peak(outcome, KV_USAGE_METRICS)
    if usage is not None and usage >= KV_BOUND_USAGE_PERCENT:
        return f"peak KV usage {usage:g}%"
    return None


def batch_never_filled(setting: Setting, outcome: TrialOutcome) -> str | None:
    """Why a larger max-num-seqs in this setting's column cannot raise its capacity, or None.

    A capacity trial that met the SLO while KV-bound, and whose mean running requests stayed under
    BATCH_FILLED_FRACTION of its max-num-seqs at every load step that failed (at least one, each measured): past its
    capacity the batch never filled, so the KV cache, not max-num-seqs, is what held its load back."""
    if not outcome.met:
        return None
    kv = _kv_evidence(outcome)
    failing = [s for s in outcome.steps if s.verdict is Verdict.VIOLATED]
    if kv is None or not failing:
        return None
    running = [s.metrics.get(M.RUNNING_REQUESTS) for s in failing]
    values = [float(r) for r in running if isinstance(r, (int, float)) and math.isfinite(r)]
    if len(values) < len(running):
        return None  # a failing step without the figure: the batch may have filled there
    limit = BATCH_FILLED_FRACTION * setting.max_num_seqs
    if max(values) >= limit:
        return None
    return (f"{setting.label()} met the SLO KV-bound ({kv}) but its batch never filled (mean running requests at most "
            f"{max(values):g} < {BATCH_FILLED_FRACTION:g} x max-num-seqs {setting.max_num_seqs} at every failing load "
            "step): the KV cache limits it, so a larger max-num-seqs cannot help")


def _classify(outcome: TrialOutcome, slo: SloTargets) -> _Kind:
    if outcome.met:
        return _Kind.MET
    if outcome.state is TrialState.DONE and outcome.verdict is Verdict.VIOLATED:
        return _Kind.TOO_SMALL if queued_miss(outcome, slo) else _Kind.VIOLATED
    if outcome.state is TrialState.INFEASIBLE and (
        outcome.reason in MEMORY_REASONS or outcome.reason == Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH
    ):
        return _Kind.VIOLATED
    return _Kind.NOINFO


def _mbt_at_least(candidate: int | None, failed: int | None) -> bool:
    if candidate is None or failed is None:
        return candidate is None and failed is None
    return candidate >= failed


def blocked_reason(setting: Setting, history: list[HistoryEntry]) -> str | None:
    """Why memory failures in the history rule this setting out, or None."""
    burst = burst_excluded(setting, history)
    if burst:
        return burst
    for failed, outcome in history:
        if outcome.state is not TrialState.INFEASIBLE or failed == setting:
            continue
        if (
            outcome.reason == Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH
            and setting.gpu_memory_utilization_percent >= failed.gpu_memory_utilization_percent
        ):
            return (
                f"infeasible: gmu {setting.gpu_memory_utilization_percent}% >= "
                f"{failed.gpu_memory_utilization_percent}%, where vLLM found less free GPU memory than asked ({failed.label()})"
            )
        if (
            outcome.reason in MEMORY_REASONS
            and setting.max_num_seqs >= failed.max_num_seqs
            and setting.gpu_memory_utilization_percent <= failed.gpu_memory_utilization_percent
            and _mbt_at_least(setting.max_num_batched_tokens, failed.max_num_batched_tokens)
        ):
            return (
                f"infeasible: needs at least the memory of {failed.label()}, which failed with {outcome.reason}"
            )
    return None


@dataclass
class _ColumnState:
    key: Column
    settings: tuple[Setting, ...]
    kinds: dict[int, _Kind] = field(default_factory=dict)
    outcomes: dict[int, TrialOutcome] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    blocked: dict[int, str] = field(default_factory=dict)
    capped: dict[int, str] = field(default_factory=dict)
    """Met settings whose batch never filled (`batch_never_filled`): nothing larger in the column can help."""

    @property
    def lo(self) -> int:
        return max((i for i, k in self.kinds.items() if k is _Kind.MET), default=-1)

    @property
    def floor(self) -> int:
        """The largest index known to be too small (requests queued), or -1."""
        return max((i for i, k in self.kinds.items() if k is _Kind.TOO_SMALL), default=-1)

    @property
    def bottom(self) -> int:
        """Everything at or below this index is settled: met, or too small."""
        return max(self.lo, self.floor)

    @property
    def hi(self) -> int:
        bottom = self.bottom
        bounds = [i for i, k in self.kinds.items() if k is _Kind.VIOLATED and i > bottom]
        bounds += [i for i in self.blocked if i > bottom]
        bounds += [i + 1 for i in self.capped if i >= bottom]
        return min(bounds, default=len(self.settings))

    def untried(self, i: int) -> bool:
        return i not in self.kinds and i not in self.pending and i not in self.blocked

    def available(self) -> list[int]:
        return [i for i in range(self.bottom + 1, self.hi) if self.untried(i)]

    @property
    def converged(self) -> bool:
        bottom, hi = self.bottom, self.hi
        return not self.available() and not any(bottom < i < hi for i in self.pending)

    def boundary_seqs(self) -> int | None:
        if self.lo >= 0:
            return self.settings[self.lo].max_num_seqs
        if self.floor >= 0:  # the feasible band, if any, starts above the largest too-small setting
            return self.settings[min(self.floor + 1, len(self.settings) - 1)].max_num_seqs
        if any(k is _Kind.VIOLATED for k in self.kinds.values()):
            return self.settings[0].max_num_seqs
        return None

    def kv_bound(self) -> tuple[bool, str]:
        """Whether more KV cache could move this column's boundary, and the evidence."""
        for i, outcome in self.outcomes.items():
            if outcome.state is TrialState.INFEASIBLE and outcome.reason in MEMORY_REASONS:
                return True, f"{self.settings[i].label()} failed with {outcome.reason}"
        if any(r.startswith("infeasible: needs") for r in self.blocked.values()):
            return True, "larger settings were ruled out by memory"
        evidence: list[str] = []
        unknown = True
        for i in (self.lo, self.hi):
            found = self.outcomes.get(i)
            if found is None:
                continue
            outcome = found
            preemptions = _peak(outcome, PREEMPTION_METRICS)
            usage = _peak(outcome, KV_USAGE_METRICS)
            if preemptions is not None and preemptions > 0:
                return True, f"{self.settings[i].label()} preempted {preemptions:g}/s"
            if usage is not None and usage >= KV_BOUND_USAGE_PERCENT:
                return True, f"{self.settings[i].label()} used {usage:g}% of the KV cache"
            if usage is not None or preemptions is not None:
                unknown = False
                evidence.append(
                    f"{self.settings[i].label()}: KV usage {usage if usage is not None else '?'}%, "
                    f"preemptions {preemptions if preemptions is not None else '?'}/s"
                )
        if unknown:
            return True, "KV usage was not measured, so more memory might help"
        return False, "; ".join(evidence)


def _spread_pick(available: list[int], anchors: set[int]) -> int:
    """The available index farthest from every anchor (bisection); ties go to the smaller index."""
    return max(available, key=lambda i: (min(abs(i - a) for a in anchors), -i))


class Adaptive(Strategy):
    kind = "Adaptive"

    def _columns(self, history: list[HistoryEntry], pending: frozenset[Setting]) -> list[_ColumnState]:
        states = []
        capacity = self.objective.searches_capacity
        for key, settings in self.plan.columns().items():
            state = _ColumnState(key, settings)
            index = {s: i for i, s in enumerate(settings)}
            for setting, outcome in history:  # later repeats of a setting override earlier ones
                if setting in index:
                    state.kinds[index[setting]] = _classify(outcome, self.slo)
                    state.outcomes[index[setting]] = outcome
                    never_filled = batch_never_filled(setting, outcome) if capacity else None
                    if never_filled:
                        state.capped[index[setting]] = never_filled
                    else:
                        state.capped.pop(index[setting], None)
            state.pending = {index[s] for s in pending if s in index}
            for i, setting in enumerate(settings):
                reason = blocked_reason(setting, history)
                if reason and i not in state.kinds:
                    state.blocked[i] = reason
            states.append(state)
        return states

    def _gate(self, states: list[_ColumnState], history: list[HistoryEntry]) -> dict[Column, str | None]:
        """Column -> None (open), "wait" (lower gmu still running) or the reason it is dominated."""
        gates: dict[Column, str | None] = {}
        by_key = {s.key: s for s in states}
        for state in states:
            gmu, mbt = state.key
            burst = burst_excluded(state.settings[0], history) if state.settings else None
            if burst:  # the burst fills the budget whatever the batch size: the whole column fails it
                gates[state.key] = f"dominated: {burst}"
                continue
            lower = [k for k in by_key if k[1] == mbt and k[0] < gmu]
            if not lower:
                gates[state.key] = None
                continue
            prev = by_key[max(lower)]
            prev_gate = gates[prev.key]
            if prev_gate is not None:  # waiting or dominated below: the same holds one gmu up
                gates[state.key] = prev_gate
                continue
            if not prev.converged:
                gates[state.key] = "wait"
                continue
            bound, evidence = prev.kv_bound()
            gates[state.key] = None if bound else (
                f"dominated: gmu {prev.key[0]}% was not KV-bound at its SLO boundary ({evidence}), "
                "so more GPU memory would not lower latency"
            )
        return gates

    def _hint(self, state: _ColumnState, states: list[_ColumnState]) -> int | None:
        """Where to start a fresh column: the boundary of the nearest finished column."""
        done = [s for s in states if s is not state and s.converged and s.kinds]
        same_mbt = [s for s in done if s.key[1] == state.key[1] and s.key[0] < state.key[0]]
        same_gmu = [s for s in done if s.key[0] == state.key[0]]
        for group in (sorted(same_mbt, key=lambda s: -s.key[0]), same_gmu, done):
            for source in group:
                seqs = source.boundary_seqs()
                if seqs is not None:
                    return seqs
        return None

    def _probe(self, state: _ColumnState, states: list[_ColumnState]) -> int | None:
        available = state.available()
        if not available:
            return None
        hint = self._hint(state, states)
        hint_index = None
        if hint is not None:
            hint_index = min(
                range(len(state.settings)),
                key=lambda i: (abs(math.log2(state.settings[i].max_num_seqs / hint)), i),
            )
        if not state.kinds and not state.pending and hint_index is not None:
            return min(available, key=lambda i: (abs(i - hint_index), i))
        if len(state.kinds) == 1 and not state.pending and hint_index is not None:
            (i, kind), = state.kinds.items()
            step = {_Kind.MET: 1, _Kind.TOO_SMALL: 1, _Kind.VIOLATED: -1}.get(kind)
            if i == hint_index and step and i + step in available:
                return i + step  # bracket next to the hinted boundary before bisecting
        anchors = {state.bottom, state.hi} | state.pending
        anchors |= {i for i, k in state.kinds.items() if k is _Kind.NOINFO}
        return _spread_pick(available, anchors)

    def _knee_probe(self, state: _ColumnState) -> int | None:
        """One more point near the knee, so selection can tell where gains flatten."""
        mets = sorted(i for i, k in state.kinds.items() if k is _Kind.MET)
        points = {i: p for i in mets if (p := curve_point(state.settings[i].max_num_seqs, state.outcomes[i].metrics))}
        measured = sorted(points)
        if not measured:
            return None
        if len(measured) == 1:
            below = measured[0] - 1
            return below if below >= 0 and state.untried(below) else None
        knee = find_knee(list(points.values()))
        if knee is not None:
            a = next(i for i in measured if state.settings[i].max_num_seqs == knee.max_num_seqs)
            b = measured[measured.index(a) + 1]
            between = [i for i in range(a + 1, b) if state.untried(i)]
            if between:
                return _spread_pick(between, {a, b})
            if a == measured[0] and a > 0 and state.untried(a - 1):
                return a - 1  # the knee may sit lower still
        # The smallest batch measured scores best: the objective is flat or falling from there, so
        # the best batch may sit lower still.
        first = measured[0]
        best = max(measured, key=lambda i: (self._value(state.outcomes[i]) or 0.0, -i))
        return first - 1 if best == first and first > 0 and state.untried(first - 1) else None

    def _value(self, outcome: TrialOutcome) -> float | None:
        return outcome.objective if outcome.objective is not None else objective_value(self.objective, outcome.metrics)

    def _best_column(self, states: list[_ColumnState]) -> _ColumnState | None:
        best: tuple[float, _ColumnState] | None = None
        for state in states:
            for i, outcome in state.outcomes.items():
                if state.kinds.get(i) is not _Kind.MET:
                    continue
                value = outcome.objective
                if value is None:
                    value = objective_value(self.objective, outcome.metrics)
                if value is not None and (best is None or value > best[0]):
                    best = (value, state)
        return best[1] if best else None

    def _next(self, history: list[HistoryEntry], pending: frozenset[Setting]) -> Setting | None:
        states = self._columns(history, pending)
        gates = self._gate(states, history)
        for state in states:
            if gates[state.key] is None:
                probe = self._probe(state, states)
                if probe is not None:
                    return state.settings[probe]
        if any(g == "wait" for g in gates.values()) or any(
            not s.converged for s in states if gates[s.key] is None
        ):
            return None  # a column is still bracketing; its pending trials decide what comes next
        best = self._best_column([s for s in states if gates[s.key] is None])
        if best is not None:
            probe = self._knee_probe(best)
            if probe is not None:
                return best.settings[probe]
        return None

    def skipped(self, history: History | None = None) -> list[PrunedSetting]:
        entries = list(self._told if history is None else history)
        states = self._columns(entries, frozenset())
        gates = self._gate(states, entries)
        out: list[PrunedSetting] = []
        for state in states:
            gate = gates[state.key]
            hi = state.hi
            for i, setting in enumerate(state.settings):
                if i in state.kinds:
                    continue
                if i in state.blocked:
                    out.append(PrunedSetting(setting, Reason.DOMINATED, state.blocked[i]))
                elif gate not in (None, "wait"):
                    out.append(PrunedSetting(setting, Reason.DOMINATED, gate))
                elif i >= hi and state.kinds.get(hi) is _Kind.VIOLATED:
                    out.append(PrunedSetting(
                        setting, Reason.DOMINATED, f"dominated: {state.settings[hi].label()} already violated the SLO"
                    ))
                elif i >= hi and hi - 1 in state.capped:
                    out.append(PrunedSetting(setting, Reason.DOMINATED, f"dominated: {state.capped[hi - 1]}"))
                elif i < state.floor:
                    out.append(PrunedSetting(
                        setting, Reason.DOMINATED, f"dominated: {state.settings[state.floor].label()} was too small "
                        "for the load (it missed the SLO with requests waiting)"
                    ))
        return out
