"""Applying, Verifying, rolling back: production changes that survive crashes and concurrent edits.

Every patch to production is conditional on the resourceVersion just read and carries the
`batchtune.io/applied` mark in the same request (`core.production`). The command line applied is
recomputed from production's container and the chosen knobs at apply time, never taken from status.
A rollback restores only what the mark says was there, only while production still runs what
batchtune applied.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from batchtune.api import AppliedRecord
from batchtune.api import ContainerArgs as ArgsRecord
from batchtune.controller import failpoints, telemetry
from batchtune.controller.ports import Conflict
from batchtune.controller.tick import Target, Tick, iso
from batchtune.core import verify as verifying
from batchtune.core.production import (
    ANNOTATION_APPLIED,
    ANNOTATION_APPLIED_AT,
    AppliedMark,
    MarkState,
    Restore,
    args_patch,
    container_of,
    fingerprint,
    rollback_decision,
    rollout_complete,
)
from batchtune.core.recommend import ContainerArgs
from batchtune.core.verify import Next, VerifyPolicy
from batchtune.core.vocabulary import ConditionType, Phase, Reason, Verdict
from batchtune.prometheus import PrometheusUnavailable


def policy(tick: Tick) -> VerifyPolicy:
    a = tick.spec.apply
    return VerifyPolicy(a.verify_seconds, a.verify_timeout_seconds, a.verify_min_requests, a.max_regression_percent,
                        a.on_inconclusive_verify)


def apply(tick: Tick) -> None:
    assert tick.status.recommendation is not None
    target = tick.target()
    if target is None:
        return
    uid, generation = tick.tuning.uid, tick.tuning.generation
    mark = AppliedMark.read(target.deployment)
    if mark is not None and mark.by(uid, generation, tick.status.round or 1):
        resume_from_mark(tick, target, mark)  # patched before a crash took the status write
        return
    if tick.status.baseline and tick.status.baseline.fingerprint != fingerprint(target.container):
        tick.target_changed(target)
        return
    mode = tick.mode_decision(target)
    if mode.forced:  # a controller took ownership of the target after the selection: never patched
        message = f"Recommended {tick.status.best_setting or 'the chosen setting'}, not applied ({mode.why})"
        tick.set_phase(Phase.RECOMMENDED, Reason.TARGET_OWNED, message)
        tick.event(True, Reason.TARGET_OWNED, message)
        return
    setting = tick.status.recommendation.setting.core()
    change = tick.args_change(target)
    if change is None:
        return
    current, desired = change
    if cooling_down(tick, target):
        return
    if not tick.checkpointed(target, current, desired):
        return  # production's window and exact args before touching it, checkpointed first
    applied = tick.status.applied
    assert applied is not None
    mark = AppliedMark(tick.tuning.name, uid, generation, str(target.container["name"]), current, desired, tick.now,
                       round=tick.status.round or 1)
    annotations = {ANNOTATION_APPLIED: mark.to_annotation(), ANNOTATION_APPLIED_AT: iso(tick.now)}
    try:
        tick.ports.cluster.patch_deployment(tick.tuning.namespace, target.name,
                                            args_patch(mark.container, desired, annotations, target.resource_version),
                                            target.resource_version)
    except Conflict:
        tick.waiting(Reason.APPLY_CONFLICT, f"Deployment {tick.tuning.namespace}/{target.name} changed while batchtune "
                                            "was applying; reading it again")
        return
    failpoints.reach("after-production-patch")  # the failover test's crash between the patch and its status write
    applied.applied_at = tick.now
    applied.new = ArgsRecord.of(desired)
    label = tick.status.best_setting or setting.label()
    tick.event(False, Reason.RECOMMENDATION_APPLIED, f"Patched {tick.tuning.namespace}/{target.name} to {label}")
    tick.log.info("Applied %s to %s", label, target.name)
    tick.set_phase(Phase.VERIFYING, Reason.APPLIED, f"Verifying {label} on production for at least "
                                                    f"{tick.spec.apply.verify_seconds}s")


def cooling_down(tick: Tick, target: Target) -> bool:
    """Production changed less than spec.apply.cooldownSeconds ago (then the tick waits, saying until when)."""
    last = ((target.deployment["metadata"].get("annotations") or {}).get(ANNOTATION_APPLIED_AT))
    if not last:
        return False
    try:
        until = datetime.fromisoformat(last.replace("Z", "+00:00")) + timedelta(seconds=tick.spec.apply.cooldown_seconds)
    except ValueError:
        until = tick.now
    if until <= tick.now:
        return False
    tick.waiting(Reason.COOLDOWN_ACTIVE, f"Production was changed at {last}; spec.apply.cooldownSeconds "
                                         f"holds the next change until {iso(until)}")
    return True


def resume_from_mark(tick: Tick, target: Target, mark: AppliedMark) -> None:
    """Status catches up with what production's own record says this generation did."""
    applied = tick.status.applied or AppliedRecord(generation=mark.generation, target=target.name)
    applied.previous = ArgsRecord.of(mark.previous)
    applied.new = ArgsRecord.of(mark.applied)
    applied.applied_at = applied.applied_at or mark.applied_at
    tick.status.applied = applied
    if mark.state is MarkState.ROLLED_BACK:
        applied.rolled_back_at = applied.rolled_back_at or tick.now
        tick.set_phase(Phase.ROLLED_BACK, Reason.ROLLED_BACK, "Production's record says this change was rolled back")
    elif mark.state in (MarkState.VERIFIED, MarkState.KEPT):
        applied.verified_at = applied.verified_at or tick.now
        tick.set_phase(Phase.SUCCEEDED, Reason.VERIFIED if mark.state is MarkState.VERIFIED else Reason.KEPT_UNVERIFIED,
                       "Production's record says this change was verified")
    else:
        tick.set_phase(Phase.VERIFYING, Reason.APPLIED, "Resumed verifying the change production's record shows")


def verify(tick: Tick) -> None:
    applied = tick.status.applied
    target = tick.target(applied.target if applied and applied.target else None)
    if target is None or applied is None or applied.applied_at is None:
        return
    if from_git(tick):
        # PullRequest mode: no mark on production (Git wrote it); production must still run the proposed args.
        mark = AppliedMark(tick.tuning.name, tick.tuning.uid, tick.tuning.generation, str(target.container["name"]),
                           applied.previous.core() if applied.previous else ContainerArgs(None, None),
                           applied.new.core() if applied.new else ContainerArgs(None, None), applied.applied_at,
                           round=tick.status.round or 1)
    else:
        read = AppliedMark.read(target.deployment)
        if read is None or not read.by(tick.tuning.uid, tick.tuning.generation, tick.status.round or 1):
            changed_by_others(tick, target.name, "its batchtune.io/applied record no longer names this BatchTuning")
            return
        mark = read
        if mark.state is not MarkState.APPLIED:
            resume_from_mark(tick, target, mark)
            return
    current = container_of(target.deployment, mark.container)
    if current is None or ContainerArgs.of(current) != mark.applied:
        changed_by_others(tick, target.name, "its container's command line is no longer what batchtune applied")
        return
    if rolled_out(tick, target, applied):
        judge_window(tick, target, mark, applied)


def rolled_out(tick: Tick, target: Target, applied: AppliedRecord) -> bool:
    """Whether production's rollout is done and recorded (a stuck one rolls back); the window starts there."""
    assert applied.applied_at is not None
    if not rollout_complete(target.deployment):
        deadline = applied.applied_at + timedelta(seconds=tick.spec.trial.readiness_timeout_seconds)
        if tick.now > deadline:
            rollback(tick, Reason.ROLLOUT_STUCK, "the rollout did not complete within "
                     f"{tick.spec.trial.readiness_timeout_seconds}s (spec.trial.readinessTimeoutSeconds)")
        else:
            tick.waiting(Reason.WAITING_FOR_ROLLOUT, f"Waiting for {target.name} to roll out")
        return False
    if applied.rollout_completed_at is None:
        applied.rollout_completed_at = tick.now
        return False
    return True


def judge_window(tick: Tick, target: Target, mark: AppliedMark, applied: AppliedRecord) -> None:
    """Production since the rollout against its figures before: wait, verified, rolled back or inconclusive."""
    rules = policy(tick)
    start = applied.rollout_completed_at
    assert start is not None
    end = tick.now - timedelta(seconds=tick.ports.install.scrape_lag_seconds)
    if end < start + timedelta(seconds=rules.verify_seconds):
        return
    try:
        after = tick.reader(target.engine).production_window(tick.production(target), start, end)
    except PrometheusUnavailable as exc:
        tick.prometheus_down(exc)
        if verifying.window_state(rules, start, end, None) is Next.INCONCLUSIVE:
            inconclusive(tick, target, mark, None, f"Prometheus did not answer: {exc}")
        return
    tick.prometheus_ok()
    requests = after.get("requests")
    state = verifying.window_state(rules, start, end, requests)
    if state is Next.WAIT:
        tick.waiting(Reason.WAITING_FOR_TRAFFIC, f"Production served {int(requests or 0)} of the "
                     f"{rules.min_requests} requests verify needs (spec.apply.verifyMinRequests); waiting until "
                     f"{iso(start + timedelta(seconds=rules.timeout_seconds))} at most")
        return
    if state is Next.INCONCLUSIVE:
        inconclusive(tick, target, mark, requests)
        return
    result = verifying.judge(tick.view.slo, rules.max_regression_percent, applied.before or {}, after)
    if result.verdict is Verdict.UNKNOWN:
        if tick.now >= start + timedelta(seconds=rules.timeout_seconds):
            inconclusive(tick, target, mark, requests, result.reason)
        else:
            tick.waiting(Reason.WAITING_FOR_TRAFFIC, f"Not enough evidence yet: {result.reason}")
        return
    if result.verdict is Verdict.VIOLATED:
        rollback(tick, Reason.REGRESSION, result.reason)
        return
    if not set_mark(tick, target, mark.with_state(MarkState.VERIFIED)):
        return
    applied.verified_at = tick.now
    applied.after = {k: v for k, v in after.items() if v is not None}
    message = f"{tick.status.best_setting} verified on production: {result.reason}"
    tick.set_phase(Phase.SUCCEEDED, Reason.VERIFIED, message)
    tick.event(False, Reason.VERIFIED, message)


def inconclusive(tick: Tick, target: Target, mark: AppliedMark, requests: float | None, why: str = "") -> None:
    rules = policy(tick)
    reason, message = verifying.inconclusive(rules, requests, why)
    if reason is Reason.VERIFY_INCONCLUSIVE:
        rollback(tick, reason, message)
        return
    if not set_mark(tick, target, mark.with_state(MarkState.KEPT)):
        return
    assert tick.status.applied is not None
    tick.status.applied.verified_at = tick.now
    tick.set_phase(Phase.SUCCEEDED, reason, message)
    tick.condition(ConditionType.DEGRADED, True, reason, message)
    tick.event(True, reason, message)


def from_git(tick: Tick) -> bool:
    """Whether this round's production change came from Git (PullRequest mode), not from a patch of ours."""
    record = tick.status.pull_request
    return record is not None and record.generation == tick.tuning.generation and \
        (record.round or 1) == (tick.status.round or 1)


def regressed(tick: Tick, reason: Reason, message: str) -> None:
    """Verify failed on a change Git made: batchtune cannot roll it back; it says what to revert."""
    record = tick.status.pull_request
    commit = f"commit {record.commit[:12]} ({record.branch})" if record and record.commit else "the merged change"
    text = (f"{message}; production runs a change from Git, which batchtune does not overwrite: revert {commit} in "
            "Git to restore the previous setting")
    tick.condition(ConditionType.DEGRADED, True, reason, text)
    tick.fail(reason, text)


def set_mark(tick: Tick, target: Target, mark: AppliedMark) -> bool:
    """Write the mark's new state onto production (annotations only); False on a conflict (next tick).
    PullRequest mode writes nothing to production: the state lives in status alone."""
    if from_git(tick):
        return True
    patch = {"metadata": {"resourceVersion": target.resource_version,
                          "annotations": {ANNOTATION_APPLIED: mark.to_annotation()}}}
    try:
        tick.ports.cluster.patch_deployment(tick.tuning.namespace, target.name, patch, target.resource_version)
    except Conflict:
        return False
    return True


def changed_by_others(tick: Tick, target: str, what: str) -> None:
    message = (f"Deployment {tick.tuning.namespace}/{target} was changed by someone else after batchtune applied "
               f"its setting ({what}); batchtune neither verifies nor rolls back a change it no longer owns")
    tick.condition(ConditionType.DEGRADED, True, Reason.PRODUCTION_CHANGED_BY_OTHERS, message)
    tick.fail(Reason.PRODUCTION_CHANGED_BY_OTHERS, message)


def restore(tick: Tick, target_name: str) -> Restore:
    """Put production's previous command line back, if it still runs what this BatchTuning applied.

    `Conflict` when production changed between the read and the patch (decide again next tick).
    """
    deployment = tick.ports.cluster.deployment(tick.tuning.namespace, target_name)
    if deployment is None:
        return Restore.NOTHING
    decision, mark = rollback_decision(deployment, tick.tuning.uid, status_previous(tick, AppliedMark.read(deployment)))
    if decision is not Restore.RESTORE:
        return decision
    assert mark is not None
    rv = str(deployment["metadata"].get("resourceVersion", ""))
    annotations = {ANNOTATION_APPLIED: mark.with_state(MarkState.ROLLED_BACK).to_annotation()}
    tick.ports.cluster.patch_deployment(tick.tuning.namespace, target_name,
                                        args_patch(mark.container, mark.previous, annotations, rv), rv)
    tick.log.info("Restored %s/%s to its previous args", tick.tuning.namespace, target_name)
    return Restore.RESTORE


def status_previous(tick: Tick, mark: AppliedMark | None) -> ContainerArgs | None:
    """The previous args status records for the mark's change, or None when status describes another generation or
    round (a crash took the status write, or a new spec or round replaced status): then the mark alone is read."""
    applied = tick.status.applied
    if mark is None or applied is None or applied.previous is None or applied.generation != mark.generation or \
            (tick.status.round or 1) != mark.round:
        return None
    return applied.previous.core()


def restore_left_over(tick: Tick, targets: Iterable[str | None], why: str) -> None:
    """Restore every change of this BatchTuning (any generation or round) that production still carries unverified.

    Read from each Deployment's `batchtune.io/applied` mark, never from status alone: a crash between a patch and
    its status write, then a new spec, a new round or a delete, leaves status without the change. Restored, not
    verified: the verify window, SLO and figures before belong to the generation or round that is gone.
    `Conflict` propagates (production changed under the restore: the caller waits and nothing else happens).
    """
    for name in dict.fromkeys(t for t in targets if t):
        decision = restore(tick, name)
        if decision is Restore.RESTORE:
            tick.event(True, Reason.ROLLED_BACK, f"Restored {tick.tuning.namespace}/{name}'s previous args ({why} "
                                                 "before batchtune's change to it was verified)")
        elif decision is not Restore.NOTHING:
            what = ("someone else changed it since" if decision is Restore.CHANGED_BY_OTHERS
                    else "its record and status name different previous args")
            message = (f"Deployment {tick.tuning.namespace}/{name} still carries an unverified change of this "
                       f"BatchTuning, but {what}; batchtune did not restore it")
            if tick.condition(ConditionType.DEGRADED, True, Reason.PRODUCTION_CHANGED_BY_OTHERS, message):
                tick.event(True, Reason.PRODUCTION_CHANGED_BY_OTHERS, message)


def rollback(tick: Tick, reason: Reason, message: str) -> None:
    applied = tick.status.applied
    assert applied is not None and applied.target is not None
    if from_git(tick):
        telemetry.ROLLBACKS.inc()
        regressed(tick, reason, message)
        return
    try:
        decision = restore(tick, applied.target)
    except Conflict:
        tick.waiting(Reason.APPLY_CONFLICT, f"Deployment {applied.target} changed while rolling back; reading it again")
        return
    if decision in (Restore.CHANGED_BY_OTHERS, Restore.DISAGREES):
        what = ("its command line is no longer what batchtune applied" if decision is Restore.CHANGED_BY_OTHERS
                else "its batchtune.io/applied record and this BatchTuning's status name different previous args")
        changed_by_others(tick, applied.target, what)
        return
    applied.rolled_back_at = tick.now
    telemetry.ROLLBACKS.inc()
    text = f"Rolled production back to its previous args: {reason.value}: {message}"
    tick.log.warning("Rolled back %s: %s: %s", applied.target, reason.value, message)
    tick.set_phase(Phase.ROLLED_BACK, reason, text)
    tick.condition(ConditionType.DEGRADED, True, reason, text)
    tick.event(True, Reason.ROLLED_BACK, text)

