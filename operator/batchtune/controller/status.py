"""Status in and out: the typed status a tick works on, its conditions, and the patch of what changed.

A tick reads the BatchTuning's status once into `batchtune.api.BatchTuningStatus`, changes that, and
writes back only the top-level keys whose wire form changed (a removed key is written as null,
which deletes it). This is the only place status is converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from batchtune.api import MAX_TRIAL_INDEX, BatchTuningStatus, Condition, ConditionStatus, parse_status
from batchtune.api.errors import InvalidBatchTuning
from batchtune.controller import records
from batchtune.core.trial_loop import KEPT_STEPS
from batchtune.core.vocabulary import ConditionType

CONDITION_ORDER = tuple(ConditionType)


def now_iso(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def load(raw: Mapping[str, Any] | None) -> BatchTuningStatus:
    """The typed status; a status this operator cannot read starts afresh (it is only a checkpoint)."""
    return read(raw)[0]


def read(raw: Mapping[str, Any] | None) -> tuple[BatchTuningStatus, str | None]:
    """The typed status and, when it cannot be read, why (naming each field and value): then a fresh status whose
    trial counter is past every readable trial index, so no trial name is reused."""
    try:
        status = parse_status(dict(raw or {}))
    except InvalidBatchTuning as exc:
        fresh = BatchTuningStatus()
        fresh.next_trial_index = _next_index(raw or {})
        return fresh, str(exc)
    for trial in status.trials:
        if trial.finished and len(trial.steps) > KEPT_STEPS:
            records.compact(trial)  # written by hand: the CRD keeps a finished trial's few steps only
    return status, None


def _next_index(raw: Mapping[str, Any]) -> int:
    """The highest trial counter the unreadable status still says plainly (a forged one out of range is ignored)."""
    trials = raw.get("trials")
    found: list[Any] = [raw.get("nextTrialIndex")]
    for trial in trials if isinstance(trials, list) else []:
        if isinstance(trial, dict) and _index(trial.get("index")):
            found.append(int(trial["index"]) + 1)
    return max((int(n) for n in found if _index(n)), default=0)


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TRIAL_INDEX


def wire(status: BatchTuningStatus) -> dict[str, Any]:
    return status.to_wire()


def patch(before: Mapping[str, Any], status: BatchTuningStatus) -> dict[str, Any]:
    """The status patch that turns `before` (a wire form) into `status`."""
    after = wire(status)
    out: dict[str, Any] = {k: v for k, v in after.items() if before.get(k) != v}
    for key in before:
        if key not in after:
            out[key] = None
    return out


def set_condition(status: BatchTuningStatus, type_: ConditionType, true: bool, reason: str, message: str,
                  generation: int | None, now: datetime) -> bool:
    """Sets a condition; True when its status or reason changed (the moment to emit an Event).

    lastTransitionTime moves only when the status flips.
    """
    value = ConditionStatus.TRUE if true else ConditionStatus.FALSE
    old = status.condition(type_)
    changed = old is None or old.status != value or old.reason != reason
    new = Condition(type=type_.value, status=value, reason=reason, message=message[:2000],
                    last_transition_time=old.last_transition_time if old is not None and old.status == value else now,
                    observed_generation=generation)
    others = [c for c in status.conditions if c.type != type_.value]
    status.conditions = sorted(others + [new], key=lambda c: CONDITION_ORDER.index(ConditionType(c.type))
                               if c.type in CONDITION_ORDER else 99)
    return changed
