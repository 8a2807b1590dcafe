"""Continuous tuning in the operator (I/O): its rounds in status, the watch between them (decisions: core/retune.py).

A BatchTuning with `spec.retune` records its rounds in `status.rounds` (the first is round 1,
`Initial`). Once a round has decided (Succeeded or Recommended), each tick looks at the watch: when
the next check is due it reads the schedule and, with drift thresholds, production's profile (the
same queries as planning's), and starts a new round when either says so. Starting a round is one
status write: a fresh tuning state with the round number, the trial counter and the history kept,
so a crash before it repeats the check and a crash after it resumes the round; rounds never
overlap. A round ends when its phase becomes terminal (`track`), with an Event saying how.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from batchtune.api import RetuneRecord, RoundRecord
from batchtune.controller import records
from batchtune.controller import status as status_io
from batchtune.controller.tick import Target, Tick
from batchtune.core.retune import MAX_ROUNDS_IN_STATUS, RetunePolicy, Trigger
from batchtune.core.vocabulary import ConditionType, Phase, Reason
from batchtune.core.workload import drift, drift_trigger
from batchtune.engines import ENGINES, ArgsError, find_engine_container
from batchtune.prometheus import PrometheusUnavailable

WATCHED_PHASES = frozenset({Phase.SUCCEEDED, Phase.RECOMMENDED})
"""A round is started only from a decision that stands; RolledBack and Failed wait for a person (a new spec)."""


def track(tick: Tick) -> None:
    """Open round 1 when a retuned tuning starts; close the open round when its phase became terminal."""
    if tick.spec.retune is None:
        return
    status = tick.status
    if not status.rounds:
        if tick.phase.terminal:
            return
        status.round = 1
        status.rounds = [RoundRecord(round=1, trigger=Trigger.INITIAL.value, reason="the BatchTuning's first tuning",
                                     started_at=tick.now)]
        return
    last = status.rounds[-1]
    if last.ended_at is not None or not tick.phase.terminal:
        return
    decided = status.condition(ConditionType.SUCCEEDED.value if tick.phase in WATCHED_PHASES
                               else ConditionType.FAILED.value)
    last.ended_at = tick.now
    last.outcome = decided.reason if decided else tick.phase.value
    last.message = (decided.message if decided else "")[:2000]
    last.workload = status.workload.summary if status.workload else None
    if last.best_setting is None and status.best_setting:
        last.best_trial, last.best_setting = status.best_trial, status.best_setting
    policy = tick.spec.retune.core()
    status.retune = RetuneRecord(next_check_at=policy.next_check(tick.now, tick.now))
    watched = tick.phase in WATCHED_PHASES
    then = "production is watched for the next one" if watched else "retuning stops here (a new spec restarts it)"
    tick.event(not watched, Reason.ROUND_ENDED, f"Round {last.round} ended: {last.outcome}: {last.message}; {then}")


def watch_due(spec: Mapping[str, Any], status: Mapping[str, Any], now: datetime) -> bool:
    """Whether a decided tuning's watch has a check to make now, from the raw spec and status.

    The timer skips a terminal tuning that has nothing to clean up; one that is watched is skipped
    only between its checks (a tick then does nothing anyway), so the watch costs nothing while idle.
    """
    if not spec.get("retune") or status.get("phase") not in {p.value for p in WATCHED_PHASES}:
        return False
    rounds = status.get("rounds") or []
    if not rounds or not rounds[-1].get("endedAt"):
        return False  # no decided round to watch after
    due = (status.get("retune") or {}).get("nextCheckAt")
    if due is None:
        return True
    try:
        at = datetime.fromisoformat(str(due))
    except ValueError:
        return True  # unreadable: let the tick read status and write a fresh one
    return now >= (at if at.tzinfo is not None else at.replace(tzinfo=UTC))


def watch(tick: Tick) -> None:
    """A decided tuning: start the next round when the schedule or production's drift says so."""
    assert tick.spec.retune is not None
    status = tick.status
    if tick.phase not in WATCHED_PHASES or not status.rounds or status.rounds[-1].ended_at is None:
        return
    record = status.retune or RetuneRecord()
    if record.next_check_at is not None and tick.now < record.next_check_at:
        return  # between checks: no query, no write
    policy = tick.spec.retune.core()
    last_ended = status.rounds[-1].ended_at
    why = policy.schedule_due(last_ended, tick.now)
    trigger = Trigger.SCHEDULE if why else None
    if why is None and policy.thresholds is not None:
        checked = check_drift(tick, policy, record)
        if checked is False:
            return  # Prometheus is down: it backs off and is asked again
        why = checked if isinstance(checked, str) and checked else None
        trigger = Trigger.DRIFT if why else None
    record.last_check_at = tick.now
    record.next_check_at = policy.next_check(last_ended, tick.now)
    status.retune = record
    if why is not None and trigger is not None:
        start_round(tick, trigger, why)


def check_drift(tick: Tick, policy: RetunePolicy, record: RetuneRecord) -> str | bool:
    """Production's drift from the round's profile: why it starts a round, "" when it does not, False: no answer."""
    assert policy.thresholds is not None
    reference = tick.status.workload.profile() if tick.status.workload else None
    if reference is None:
        record.message = "no production profile to compare with (the last round did not measure one)"
        return ""
    target = quiet_target(tick)
    if target is None:
        record.message = f"Deployment {tick.tuning.namespace}/{tick.spec.target_ref.name} not found or not an engine's"
        return ""
    try:
        measured = tick.production_profile(target)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        return False
    tick.prometheus_ok()
    if isinstance(measured, str):
        record.message = f"no drift measured: {measured}"[:1000]
        return ""
    current = measured.profile()
    assert current is not None
    moved = drift(reference, current)
    record.drift = moved.to_metrics()
    why = drift_trigger(moved, policy.thresholds)
    record.message = (why or f"within the thresholds: {_drift_words(moved.to_metrics())}")[:1000]
    return why or ""


def _drift_words(metrics: dict[str, float]) -> str:
    names = {"promptShiftPercent": "prompt lengths moved", "outputShiftPercent": "output lengths moved",
             "peakChangePercent": "peak rate changed"}
    return ", ".join(f"{names[k]} {v:+.0f}%" if k == "peakChangePercent" else f"{names[k]} {v:.0f}%"
                     for k, v in metrics.items()) or "nothing to compare"


def quiet_target(tick: Tick) -> Target | None:
    """Production's Deployment and engine container, read without setting a waiting condition (a decided phase)."""
    deployment = tick.ports.cluster.deployment(tick.tuning.namespace, tick.spec.target_ref.name)
    if deployment is None:
        return None
    pod_spec = ((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}
    try:
        engine, container = find_engine_container(pod_spec, tick.spec.target_ref.container_name,
                                                  tick.ports.engines or ENGINES)
    except ArgsError:
        return None
    return Target(deployment, engine, container)


def start_round(tick: Tick, trigger: Trigger, why: str) -> None:
    """A new round: a fresh tuning state (round number, trial counter and history kept), planned next tick."""
    old = tick.status
    number = (old.round or 1) + 1
    rounds = [*old.rounds, RoundRecord(round=number, trigger=trigger.value, reason=why[:1000], started_at=tick.now)]
    fresh = status_io.load({})
    fresh.observed_generation = old.observed_generation
    fresh.next_trial_index = old.next_trial_index
    records.carry_gpu_minutes(old, fresh, tick.now)  # the budget is the BatchTuning's, not the round's
    fresh.conditions = old.conditions
    fresh.round = number
    fresh.rounds = rounds[-MAX_ROUNDS_IN_STATUS:]
    fresh.retune = RetuneRecord(last_check_at=old.retune.last_check_at if old.retune else None,
                                drift=old.retune.drift if old.retune else None,
                                message=old.retune.message if old.retune else None)
    tick.status = fresh
    message = f"Round {number} started ({trigger.value}): {why}; production's own setting is measured as its trial 0"
    tick.set_phase(Phase.PENDING, Reason.ROUND_STARTED, message)
    tick.event(False, Reason.ROUND_STARTED, message)
    tick.log.info("Started round %d of tuning %s: %s", number, tick.tuning.name, why)
