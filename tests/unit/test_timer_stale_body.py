"""A timer run handed the BatchTuning from before its own last status write (`handlers.WrittenVersions`).

kopf refreshes a timer's body only from watch events and writes a run's status patch after the run; on a starved
control plane the event of that write can arrive after the timer's next run has started. That run decided on the old
status and concluded the trial again: the same verdict with a later `finishedAt` and a second TrialCompleted Event
(2 of 100 trials at N=100, 20 of 300 at N=300; docs/benchmarks.md, "Operator scale"). Now such a body is read again.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from datetime import UTC, datetime

import kopf
import pytest
from fake_world import World, reset_backoff, world

from batchtune.controller import handlers
from batchtune.controller.reconcile import reconcile

LOG = logging.getLogger("test")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    reset_backoff()
    monkeypatch.setattr(handlers, "WRITTEN", handlers.WrittenVersions())
    yield
    reset_backoff()


def one_trial() -> World:
    w = world(apply={"mode": "Recommend"}, strategy={"type": "Grid", "maxTrials": 1},
              searchSpace={"maxNumSeqs": {"values": [8]}})
    return w


def done(status: dict) -> dict[int, str]:
    return {t["index"]: t["finishedAt"] for t in status.get("trials") or [] if t["state"] == "Done"}


def one_reconcile_from_the_verdict(w: World) -> None:
    """Step the world on the real clock (the timer's) until its next reconcile concludes the trial."""
    for _ in range(60):
        w.now = datetime.now(UTC)
        ahead = copy.deepcopy(w)
        ahead.apply(reconcile(ahead.tuning(), ahead.ports(), ahead.now, LOG))
        if done(ahead.status):
            return
        w.apply(reconcile(w.tuning(), w.ports(), w.now, LOG))  # the same step, in the world itself
        w.settle()
    raise AssertionError(f"no reconcile concluded the trial; phase {w.phase}")


def run_timer(w: World, body: dict, monkeypatch) -> dict:
    """One run of the timer on `body` (kopf's copy); its status patch."""
    monkeypatch.setattr(handlers, "ports", lambda kwargs: w.ports())
    patch = kopf.Patch()
    asyncio.run(handlers.tick(body=kopf.Body(body), patch=patch, logger=LOG))
    return dict(patch.get("status") or {})


def completed_events(w: World) -> int:
    return sum(1 for _, reason, _ in w.events if reason == "TrialCompleted")


def test_a_run_handed_the_body_from_before_its_write_does_not_conclude_the_trial_again(monkeypatch):
    w = one_trial()
    one_reconcile_from_the_verdict(w)
    before_write = w.body()  # what kopf's watch still holds after the write below
    first = run_timer(w, before_write, monkeypatch)
    verdict = done(first)
    assert verdict and completed_events(w) == 1 and w.tuning_reads == 0  # the body was current: not read again
    w.apply(first)  # kopf's PATCH lands; its watch event does not arrive before the next run
    second = run_timer(w, before_write, monkeypatch)
    assert done(second) in ({}, verdict)  # no new finishedAt for the trial: not concluded twice
    assert completed_events(w) == 1 and w.tuning_reads == 1
    assert done({**w.status, **second}) == verdict


def test_once_the_watch_brings_the_write_the_body_is_not_read_again(monkeypatch):
    w = one_trial()
    one_reconcile_from_the_verdict(w)
    before_write = w.body()
    w.apply(run_timer(w, before_write, monkeypatch))
    w.apply(run_timer(w, before_write, monkeypatch))
    for _ in range(3):  # the watch caught up: each run's body holds the write before it
        w.apply(run_timer(w, w.body(), monkeypatch))
    assert w.tuning_reads == 1 and completed_events(w) == 1 and w.phase == "Recommended"


def test_a_write_that_never_landed_is_made_again(monkeypatch):
    w = one_trial()
    one_reconcile_from_the_verdict(w)
    body = w.body()
    first = done(run_timer(w, body, monkeypatch))
    assert first  # kopf's PATCH of it failed: the object stays as it was
    second = run_timer(w, body, monkeypatch)
    assert done(second) and w.tuning_reads == 1  # read again, found unchanged, decided on it: the verdict is written
    w.apply(second)
    for _ in range(3):
        w.apply(run_timer(w, w.body(), monkeypatch))
    assert w.tuning_reads == 1 and w.phase == "Recommended"  # and nothing is read again after it


def test_when_the_object_cannot_be_read_again_the_run_writes_nothing(monkeypatch, caplog):
    w = one_trial()
    one_reconcile_from_the_verdict(w)
    before_write = w.body()
    w.apply(run_timer(w, before_write, monkeypatch))
    w.tuning_read_fails = True
    with caplog.at_level(logging.WARNING, logger="test"):
        assert run_timer(w, before_write, monkeypatch) == {}
    assert completed_events(w) == 1
    assert "reading it again failed: the API server did not answer" in caplog.text
    w.tuning_read_fails = False
    assert done(run_timer(w, before_write, monkeypatch)) in ({}, done(w.status)) and completed_events(w) == 1
