"""The level-based reconcile: look at spec, status, owned objects and Prometheus; take the next step.

    patch = reconcile(tuning, ports, now, log)     # the status patch to write

Phases: Pending -> Planning -> Trialing -> Selecting -> Applying -> Verifying -> Succeeded |
RolledBack | Failed (Recommend mode: Selecting -> Recommended). Every step is safe to repeat:
objects have deterministic names, are created only if missing, and an intent is written to status
before the object it describes is created. Every tick ends with the garbage pass, which deletes
owned objects status no longer needs (finished trials, superseded load runs, everything in a
terminal phase), so a trial's objects outlive its outcome's status write, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from batchtune.api import InvalidBatchTuning, parse_spec
from batchtune.controller import apply as applying
from batchtune.controller import gitdelivery, records, retune
from batchtune.controller import status as status_io
from batchtune.controller.decide import select, submit_report
from batchtune.controller.plan import plan
from batchtune.controller.ports import Conflict, NotAllowed, Ports
from batchtune.controller.tick import Log, Tick, Tuning
from batchtune.controller.trials import trials
from batchtune.core.vocabulary import ConditionType, Phase, Reason

STEPS = {
    Phase.PENDING: plan, Phase.PLANNING: plan, Phase.TRIALING: trials, Phase.SELECTING: select,
    Phase.APPLYING: applying.apply, Phase.VERIFYING: applying.verify,
    Phase.PROPOSING: gitdelivery.propose, Phase.AWAITING_MERGE: gitdelivery.await_merge,
}


@dataclass(frozen=True)
class Outcome:
    """What one tick decided: the status patch to write, and when to run again sooner than the timer would."""

    patch: dict[str, Any]
    wake_at: datetime | None = None
    """The earliest moment a step this tick waited for becomes possible (`Tick.wake`); None: the timer's next run."""
    load_run_going: bool = False
    """A load run was still going (`Tick.load_run_going`): its end can wake the timer."""


def reconcile(tuning: Tuning, ports: Ports, now: datetime, log: Log) -> dict[str, Any]:
    """One tick: the status patch that records the step taken (empty when nothing changed)."""
    return reconcile_outcome(tuning, ports, now, log).patch


def reconcile_outcome(tuning: Tuning, ports: Ports, now: datetime, log: Log) -> Outcome:
    """One tick: its status patch and its wake-up (`Outcome`)."""
    tick = Tick(tuning, ports, now, log)
    # An unreadable status is overwritten whole: every key the fresh one lacks is deleted.
    before = dict(tuning.status or {}) if tick.status_problem else status_io.wire(tick.status)
    try:
        if tick.status_problem:
            unreadable(tick)
        step(tick)
    finally:
        collect_garbage(tick)
    return Outcome(status_io.patch(before, tick.status), tick.wake_at, tick.load_run_going)


def step(tick: Tick) -> None:
    observed = tick.status.observed_generation
    if observed is not None and observed != tick.tuning.generation:
        restart(tick)
        return
    if tick.phase.terminal:
        watch(tick)
        return
    try:
        tick.spec = parse_spec(dict(tick.tuning.spec or {}))
    except InvalidBatchTuning as exc:
        tick.status.observed_generation = tick.tuning.generation
        tick.fail(Reason.INVALID_SPEC, str(exc))
        return
    if tick.backing_off():
        return  # Prometheus failed recently; the next try waits out the back-off
    if observed is None:
        tick.status.observed_generation = tick.tuning.generation
        tick.status.phase = Phase.PENDING
    was = tick.phase
    try:
        if was in (Phase.PENDING, Phase.PLANNING) and not left_over_restored(tick):
            return
        STEPS[tick.phase](tick)
    except NotAllowed as exc:  # the install refuses the spec's Prometheus URL or Secret, in any phase
        tick.not_allowed(exc)
    if was.touches_production and tick.phase.terminal:
        submit_report(tick)  # the report written at the decision did not know what production made of it
    retune.track(tick)


def unreadable(tick: Tick) -> None:
    """Status no longer reads as this operator wrote it (edited by hand, or forged): it is only a checkpoint, so the
    tuning starts afresh and says which fields were refused."""
    message = f"Status could not be read; the tuning started afresh: {tick.status_problem}"
    tick.condition(ConditionType.DEGRADED, True, Reason.STATUS_UNREADABLE, message)
    tick.event(True, Reason.STATUS_UNREADABLE, message)
    tick.log.warning("Tuning %s: %s", tick.tuning.name, message)


def watch(tick: Tick) -> None:
    """A decided tuning with spec.retune: the watch for its next round (nothing else happens in a terminal phase)."""
    if not (tick.tuning.spec or {}).get("retune"):
        return
    try:
        tick.spec = parse_spec(dict(tick.tuning.spec or {}))
    except InvalidBatchTuning:
        return  # the generation that decided was valid; a new one restarts the tuning
    if tick.backing_off():
        return
    try:
        retune.watch(tick)
    except NotAllowed as exc:
        tick.not_allowed(exc)


def restart(tick: Tick) -> None:
    """A new generation of the spec: restore production if this BatchTuning left it unverified, plan again.

    Nothing of the old generation carries over but the trial counter (names are never reused).
    """
    try:
        applying.restore_left_over(tick, left_over_targets(tick), f"spec changed to generation {tick.tuning.generation}")
    except Conflict:
        tick.waiting(Reason.APPLY_CONFLICT, "Production changed while restoring it; retrying")
        return  # the old generation stays until production is safe
    kept = tick.status.next_trial_index
    conditions = tick.status.conditions
    fresh = status_io.load({})
    fresh.next_trial_index = kept
    records.carry_gpu_minutes(tick.status, fresh, tick.now)  # the budget is the BatchTuning's, not the generation's
    fresh.pull_request = tick.status.pull_request  # a later decision supersedes its branch
    fresh.conditions = conditions
    fresh.observed_generation = tick.tuning.generation
    tick.status = fresh
    tick.set_phase(Phase.PENDING, Reason.SPEC_CHANGED, f"Spec generation {tick.tuning.generation}: planning again")
    tick.event(False, Reason.SPEC_CHANGED, f"Spec changed (generation {tick.tuning.generation}); planning again")
    tick.log.info("Restarted tuning %s for generation %s", tick.tuning.name, tick.tuning.generation)


def left_over_restored(tick: Tick) -> bool:
    """Before planning: no unverified change of this BatchTuning stays on production (a crash after a patch, then a
    new generation or round, leaves one that status does not know). False while production changes under it."""
    try:
        applying.restore_left_over(tick, left_over_targets(tick), f"a new tuning (generation {tick.tuning.generation}, "
                                                                  f"round {tick.status.round or 1}) began")
    except Conflict:
        tick.waiting(Reason.APPLY_CONFLICT, f"Deployment {tick.spec.target_ref.name} changed while restoring "
                                            "batchtune's unverified change to it; retrying")
        return False
    return True


def left_over_targets(tick: Tick) -> list[str | None]:
    """The Deployments a change of this BatchTuning may be on: the one status names, the one the spec names."""
    applied = tick.status.applied
    return [applied.target if applied else None, str((tick.tuning.spec.get("targetRef") or {}).get("name") or "")]


def collect_garbage(tick: Tick) -> None:
    """Delete owned Deployments and Jobs status does not need: only active trials keep theirs."""
    needed_deployments: set[str] = set()
    needed_jobs: set[str] = set()
    if not tick.phase.terminal:
        for trial in tick.status.trials:
            if trial.state.finished:
                continue
            needed_deployments.add(trial.name)
            needed_jobs.update(s.job for s in trial.steps if s.job and s.verdict is None)
    owned = tick.ports.cluster.owned(tick.tuning.namespace, tick.tuning.uid)
    # Judge by status as it was read: what this tick decided is written first, deleted next tick.
    written = status_io.load(tick.tuning.status)
    if written.observed_generation == tick.tuning.generation and not (written.phase or Phase.PENDING).terminal:
        for trial in written.trials:
            if not trial.state.finished:
                needed_deployments.add(trial.name)
                needed_jobs.update(s.job for s in trial.steps if s.job and s.verdict is None)
    for name in owned.jobs:
        if name not in needed_jobs:
            tick.ports.cluster.delete("Job", tick.tuning.namespace, name)
    for name in owned.deployments:
        if name not in needed_deployments:
            tick.ports.cluster.delete("Deployment", tick.tuning.namespace, name)


def on_delete(tuning: Tuning, ports: Ports, now: datetime, log: Log) -> None:
    """The BatchTuning is going: restore production if its change is unverified, delete what it owns.

    Raises `Conflict` while production changes under the restore, so the finalizer stays and kopf retries.
    """
    tick = Tick(tuning, ports, now, log)
    applying.restore_left_over(tick, left_over_targets(tick), "BatchTuning deleted")
    owned = ports.cluster.owned(tuning.namespace, tuning.uid)
    for name in owned.jobs:
        ports.cluster.delete("Job", tuning.namespace, name)
    for name in owned.deployments:
        ports.cluster.delete("Deployment", tuning.namespace, name)
    log.info("Cleaned up tuning %s (%d objects)", tuning.name, len(owned.jobs) + len(owned.deployments))
