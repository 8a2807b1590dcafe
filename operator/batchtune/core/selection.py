"""Selection: the best SLO-meeting setting, kept at or below the knee when that costs little.

Rules, in order:
1. Only trials that finished (Done), whose SLO verdict is Met, whose metrics still meet the SLO
   when re-evaluated, whose objective was measured, and that no failed full token-budget burst rules
   out (`core.burst`: the setting's own, or one at a lower or equal gmu and budget) are eligible. Repeats of a setting are
   eligible only when every repeat is; their objective is the mean.
2. The best eligible setting by objective wins (ties: the smaller, cheaper setting).
3. Knee: in the winner's (gmu, mbt) column, if the winner sits past the knee of the max-num-seqs
   curve and an eligible setting at or below the knee reaches at least (100 - headroom)% of the
   winner's objective, that setting is chosen instead: the margin absorbs traffic peaks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from batchtune.core.burst import burst_excluded
from batchtune.core.knee import KNEE_GAIN_PERCENT, CurvePoint, Knee, curve_point, find_knee, mean_point
from batchtune.core.objective import OBJECTIVE_UNITS, Objective, objective_value
from batchtune.core.outcomes import TrialOutcome, TrialState, Verdict
from batchtune.core.settings import Setting
from batchtune.core.slo import SloTargets, evaluate_slo

OBJECTIVE_WORDS = {
    Objective.SLO_CAPACITY: "SLO capacity",
    Objective.OUTPUT_THROUGHPUT: "output throughput",
    Objective.GPU_UTILIZATION: "GPU utilization",
    Objective.TOKENS_PER_JOULE: "tokens per joule",
    Objective.GOODPUT: "goodput",
}


@dataclass(frozen=True)
class CompletedTrial:
    name: str
    setting: Setting
    outcome: TrialOutcome


@dataclass(frozen=True)
class Selection:
    best: Setting | None
    best_trial: str | None
    """Name of the chosen setting's trial (its first repeat)."""
    knee: Knee | None
    reason: str
    verdicts: Mapping[str, str] = field(default_factory=dict)
    """Trial name -> why it was chosen or not."""


def _fmt(objective: Objective, value: float) -> str:
    return f"{OBJECTIVE_WORDS[objective]} {value:.4g} {OBJECTIVE_UNITS[objective]}"


def _rejection(trial: CompletedTrial, objective: Objective, slo: SloTargets | None) -> str | None:
    outcome = trial.outcome
    detail = outcome.message or outcome.reason
    if outcome.state is not TrialState.DONE:
        return f"rejected: trial {outcome.state.value}" + (f" ({detail})" if detail else "")
    if outcome.verdict is not Verdict.MET:
        word = "violated" if outcome.verdict is Verdict.VIOLATED else "unknown"
        return f"rejected: SLO {word}" + (f" ({detail})" if detail else "")
    if slo is not None:
        again = evaluate_slo(outcome.metrics, slo)
        if again.verdict is not Verdict.MET:
            return f"rejected: SLO {again.verdict.value.lower()} on re-evaluation ({again.reason})"
    value = outcome.objective if outcome.objective is not None else objective_value(objective, outcome.metrics)
    if value is None:
        return f"rejected: {OBJECTIVE_WORDS[objective]} was not measured"
    return None


def _burst_rejection(trial: CompletedTrial, history: Sequence[tuple[Setting, TrialOutcome]]) -> str | None:
    excluded = burst_excluded(trial.setting, history)
    return f"rejected: {excluded}" if excluded else None


def _value(outcome: TrialOutcome, objective: Objective) -> float:
    value = outcome.objective if outcome.objective is not None else objective_value(objective, outcome.metrics)
    assert value is not None
    return value


def select_best(
    trials: Sequence[CompletedTrial],
    objective: Objective | str = Objective.SLO_CAPACITY,
    slo: SloTargets | None = None,
    knee_threshold_percent: float = KNEE_GAIN_PERCENT,
) -> Selection:
    """Pick the setting to recommend; `slo` (when given) re-checks every Met verdict."""
    objective = Objective(objective)
    headroom = slo.headroom_percent if slo is not None else 0
    by_setting: dict[Setting, list[CompletedTrial]] = {}
    for trial in trials:
        by_setting.setdefault(trial.setting, []).append(trial)
    eligible, verdicts = _eligible(trials, by_setting, objective, slo)
    knees = _knees(by_setting, knee_threshold_percent)
    if not eligible:
        knee = next(iter(knees.values()), None)
        reason = (
            f"no trial met the SLO among {len(trials)} trial(s)" if trials else "no trial has finished"
        )
        return Selection(None, None, knee, reason, verdicts)
    ranked = sorted(eligible, key=lambda s: (-eligible[s], s.max_num_seqs, s.sort_key()))
    top = ranked[0]
    knee = knees.get(top.column)
    chosen, reason = _below_the_knee(ranked, eligible, objective, knee, headroom)
    verdicts.update(_verdicts(by_setting, eligible, objective, chosen, top, reason))
    return Selection(chosen, by_setting[chosen][0].name, knee, reason, verdicts)


def _eligible(trials: Sequence[CompletedTrial], by_setting: Mapping[Setting, list[CompletedTrial]],
              objective: Objective, slo: SloTargets | None) -> tuple[dict[Setting, float], dict[str, str]]:
    """The settings every repeat of which met the SLO, with their mean objective; why the others are rejected."""
    verdicts: dict[str, str] = {}
    history = [(t.setting, t.outcome) for t in trials]
    for trial in trials:
        rejection = _rejection(trial, objective, slo) or _burst_rejection(trial, history)
        if rejection:
            verdicts[trial.name] = rejection
    eligible: dict[Setting, float] = {}
    for setting, group in by_setting.items():
        failed = [t.name for t in group if t.name in verdicts]
        if failed:
            for t in group:
                verdicts.setdefault(t.name, f"rejected: another repeat of {setting.label()} ({failed[0]}) was rejected")
            continue
        eligible[setting] = sum(_value(t.outcome, objective) for t in group) / len(group)
    return eligible, verdicts


def _below_the_knee(ranked: Sequence[Setting], eligible: Mapping[Setting, float], objective: Objective,
                    knee: Knee | None, headroom: int) -> tuple[Setting, str]:
    """The best setting, or the best at or below its column's knee when that costs no more than the headroom."""
    top = ranked[0]
    reason = f"{top.label()}: highest {_fmt(objective, eligible[top])} of {len(eligible)} setting(s) meeting the SLO"
    if knee is None:
        return top, reason
    if top.max_num_seqs <= knee.max_num_seqs:
        return top, reason + f"; knee at max-num-seqs {knee.max_num_seqs}"
    below = [s for s in ranked if s.column == top.column and s.max_num_seqs <= knee.max_num_seqs]
    floor = eligible[top] * (100 - headroom) / 100
    if below and eligible[below[0]] >= floor:
        chosen = below[0]
        return chosen, (
            f"{chosen.label()}: at or below the knee (max-num-seqs {knee.max_num_seqs}: {knee.reason}); "
            f"{_fmt(objective, eligible[chosen])} is within {headroom}% of the best "
            f"({top.label()}, {eligible[top]:.4g}), so the margin is kept"
        )
    return top, reason + (f"; past the knee at max-num-seqs {knee.max_num_seqs}, but staying below it would cost "
                          f"more than the {headroom}% headroom")


def _verdicts(by_setting: Mapping[Setting, list[CompletedTrial]], eligible: Mapping[Setting, float],
              objective: Objective, chosen: Setting, top: Setting, reason: str) -> dict[str, str]:
    """Why each eligible trial was or was not chosen."""
    verdicts: dict[str, str] = {}
    for setting, value in eligible.items():
        for t in by_setting[setting]:
            if setting == chosen:
                verdicts[t.name] = f"chosen: {reason}"
            elif setting == top:
                verdicts[t.name] = f"not chosen: best {_fmt(objective, value)} but past the knee; {chosen.label()} keeps headroom"
            else:
                met = f"not chosen: met the SLO with {_fmt(objective, value)}"
                if value < eligible[chosen]:
                    verdicts[t.name] = f"{met}, below {eligible[chosen]:.4g} of {chosen.label()}"
                elif chosen == top:  # a tie: the smaller setting ranks first
                    verdicts[t.name] = f"{met}, the same as {chosen.label()}, which ranks first as the smaller setting"
                else:
                    verdicts[t.name] = f"{met}; {chosen.label()} was preferred for keeping headroom below the knee"
    return verdicts


def _knees(by_setting: Mapping[Setting, list[CompletedTrial]], threshold: float) -> dict[tuple[int, int | None], Knee]:
    """Knee per (gmu, mbt) column from every Done trial (the curve is physical, met or not)."""
    columns: dict[tuple[int, int | None], list[CurvePoint]] = {}
    for setting, group in by_setting.items():
        done = [t for t in group if t.outcome.state is TrialState.DONE]
        points = [p for t in done if (p := curve_point(setting.max_num_seqs, t.outcome.metrics))]
        if points:
            columns.setdefault(setting.column, []).append(mean_point(points))
    knees = {}
    for column, points in columns.items():
        knee = find_knee(points, threshold)
        if knee is not None:
            knees[column] = knee
    return knees
