"""Conditions on the typed status, and the status patch of what changed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from batchtune.api import BatchTuningStatus, ConditionStatus, Phase
from batchtune.controller.status import load, patch, set_condition
from batchtune.core.vocabulary import ConditionType

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=5)


def test_condition_transition_time_moves_only_on_flip():
    status = BatchTuningStatus()
    assert set_condition(status, ConditionType.PROGRESSING, True, "Planned", "m", 1, NOW) is True
    first = status.condition("Progressing")
    assert first is not None and first.status is ConditionStatus.TRUE and first.last_transition_time == NOW

    assert set_condition(status, ConditionType.PROGRESSING, True, "Trialing", "m2", 2, LATER) is True
    same = status.condition("Progressing")
    assert same.last_transition_time == NOW
    assert same.reason == "Trialing" and same.message == "m2" and same.observed_generation == 2

    assert set_condition(status, ConditionType.PROGRESSING, True, "Trialing", "m3", 2, LATER) is False
    assert status.condition("Progressing").message == "m3"

    assert set_condition(status, ConditionType.PROGRESSING, False, "Done", "m4", 2, LATER) is True
    flipped = status.condition("Progressing")
    assert flipped.status is ConditionStatus.FALSE and flipped.last_transition_time == LATER
    assert len(status.conditions) == 1


def test_conditions_keep_a_fixed_order_and_long_messages_are_cut():
    status = BatchTuningStatus()
    for type_ in (ConditionType.DEGRADED, ConditionType.SUCCEEDED, ConditionType.PROGRESSING):
        set_condition(status, type_, True, "R", "x" * 5000, None, NOW)
    assert [c.type for c in status.conditions] == ["Progressing", "Succeeded", "Degraded"]
    assert all(len(c.message) == 2000 for c in status.conditions)


@pytest.mark.parametrize("raw, change, expected", [
    pytest.param({}, lambda s: setattr(s, "phase", Phase.PLANNING), {"phase": "Planning"}, id="new-key"),
    pytest.param({"phase": "Planning", "trialsPlanned": 3}, lambda s: setattr(s, "trials_planned", 4),
                 {"trialsPlanned": 4}, id="only-the-changed-key"),
    pytest.param({"phase": "Planning", "bestTrial": "t-0"}, lambda s: setattr(s, "best_trial", None),
                 {"bestTrial": None}, id="removed-key-is-null"),
    pytest.param({"phase": "Planning"}, lambda s: None, {}, id="nothing-changed"),
])
def test_patch_writes_only_what_changed(raw, change, expected):
    before = load(raw).to_wire()  # what the previous tick wrote
    status = load(before)
    change(status)
    assert patch(before, status) == expected


def test_unreadable_status_starts_afresh():
    assert load({"phase": "Sleeping"}) == BatchTuningStatus()
