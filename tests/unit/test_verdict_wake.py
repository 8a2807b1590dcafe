"""The verdict wake: a tick that finds a finished load run whose window Prometheus does not hold yet says when it will
(`Outcome.wake_at`), and the timer (`handlers.tick`) reconciles again at that moment instead of a whole tick later.

Without it the verdict waited for the timer's next run: kopf counts a timer's interval from the end of a run, so the
wait after the window was complete was up to one tick plus a reconcile (docs/benchmarks.md, "Operator scale").
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import kopf
import pytest
from fake_world import LOCAL_PROMETHEUS, World, reset_backoff, world

from batchtune.api import steps_on_the_wire
from batchtune.controller import handlers
from batchtune.controller.ports import Install
from batchtune.controller.reconcile import Outcome, reconcile_outcome

LOG = logging.getLogger("test")
FAR_LAG = Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=600)
"""A scrape lag no step of the set-up outlives: every finished run's window stays incomplete while the test steps."""


@pytest.fixture(autouse=True)
def _fresh_backoff():
    reset_backoff()
    yield
    reset_backoff()


def waiting_for_a_window(w: World) -> Outcome:
    """Step the world on the real clock (no time passes for it) until a tick waits for a finished run's window."""
    w.now = datetime.now(UTC)
    for _ in range(60):
        outcome = reconcile_outcome(w.tuning(), w.ports(FAR_LAG), w.now, LOG)
        w.apply(outcome.patch)
        if outcome.wake_at is not None:
            return outcome
        w.settle()
    raise AssertionError(f"no tick waited for a window; phase {w.phase}")


def running_trial(w: World) -> dict:
    return next(t for t in w.status["trials"] if t["state"] not in ("Done", "Failed", "Infeasible"))


def waiting_for_the_last_window(w: World) -> Outcome:
    """As `waiting_for_a_window`, for the run whose reading concludes the trial (its verdict); earlier runs are read
    at their wake-up as the timer would."""
    for _ in range(10):
        outcome = waiting_for_a_window(w)
        assert outcome.wake_at is not None
        ahead = copy.deepcopy(w)
        index = running_trial(ahead)["index"]
        ahead.apply(reconcile_outcome(ahead.tuning(), ahead.ports(FAR_LAG), outcome.wake_at, LOG).patch)
        if next(t for t in ahead.status["trials"] if t["index"] == index)["state"] == "Done":
            return outcome
        w.apply(reconcile_outcome(w.tuning(), w.ports(FAR_LAG), outcome.wake_at, LOG).patch)
        w.settle()
    raise AssertionError("no run concluded the trial")


def test_a_tick_that_waits_for_a_window_says_when_it_is_complete():
    w = world(apply={"mode": "Recommend"})
    outcome = waiting_for_a_window(w)
    assert outcome.patch == {}  # nothing else changed: it only waits
    trial = running_trial(w)
    step = next(s for s in steps_on_the_wire(w.status, trial) if "verdict" not in s or s["verdict"] is None)
    job = w.jobs[step["job"]]
    message = w.pods[f"{job['metadata']['name']}-pod"]["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    window_end = datetime.fromtimestamp(json.loads(message)["measure_end"], UTC)
    assert outcome.wake_at == window_end + timedelta(seconds=600)
    # A moment before it the run is still not read; at it, it is.
    before = reconcile_outcome(w.tuning(), w.ports(FAR_LAG), outcome.wake_at - timedelta(milliseconds=1), LOG)
    assert "trials" not in before.patch and before.wake_at == outcome.wake_at
    queries = w.queries
    at = reconcile_outcome(w.tuning(), w.ports(FAR_LAG), outcome.wake_at, LOG)
    assert w.queries > queries and at.patch.get("trials") != w.status["trials"]


def test_wake_delay_only_when_the_wake_comes_before_the_timer():
    now = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    assert handlers.wake_delay(None, now, 2.0) is None
    assert handlers.wake_delay(now + timedelta(seconds=0.5), now, 2.0) == 0.5
    assert handlers.wake_delay(now - timedelta(seconds=3), now, 2.0) == 0.0  # already due: at once
    assert handlers.wake_delay(now + timedelta(seconds=2), now, 2.0) is None  # the timer comes as soon
    assert handlers.wake_delay(now + timedelta(seconds=30), now, 2.0) is None


def test_the_timer_writes_the_verdict_when_the_window_completes_not_a_tick_later(monkeypatch):
    w = world(apply={"mode": "Recommend"}, strategy={"type": "Grid", "maxTrials": 1},
              searchSpace={"maxNumSeqs": {"values": [8]}})
    outcome = waiting_for_the_last_window(w)
    window_end = outcome.wake_at - timedelta(seconds=600)
    # The same world, with the scrape lag chosen so the window completes 1.5 s from now on the real clock.
    complete = datetime.now(UTC) + timedelta(seconds=1.5)
    install = replace(FAR_LAG, scrape_lag_seconds=(complete - window_end).total_seconds())
    monkeypatch.setattr(handlers, "ports", lambda kwargs: w.ports(install))
    monkeypatch.setattr(handlers, "TICK_SECONDS", 5.0)
    trial_index = running_trial(w)["index"]
    body = kopf.Body(w.body())
    patch = kopf.Patch()
    started = time.monotonic()
    assert datetime.now(UTC) < complete  # the first reconcile of the run finds the window incomplete
    asyncio.run(handlers.tick(body=body, patch=patch, logger=LOG))
    elapsed = time.monotonic() - started
    assert datetime.now(UTC) >= complete
    verdicts = {t["index"]: t for t in patch["status"]["trials"]}
    assert verdicts[trial_index]["state"] == "Done" and verdicts[trial_index]["finishedAt"]
    assert elapsed < 5.0  # within the run, before the timer's next run would have come


def test_a_wake_beyond_the_next_timer_run_is_left_to_the_timer(monkeypatch):
    w = world(apply={"mode": "Recommend"})
    waiting_for_a_window(w)
    monkeypatch.setattr(handlers, "ports", lambda kwargs: w.ports(FAR_LAG))  # complete in ~600 s
    body = kopf.Body(w.body())
    patch = kopf.Patch()
    started = time.monotonic()
    asyncio.run(handlers.tick(body=body, patch=patch, logger=LOG))
    assert time.monotonic() - started < 1.0 and not patch  # returned at once, nothing written


def test_a_woken_reconcile_does_not_queue_behind_the_other_tunings_ticks(monkeypatch):
    """kopf's pool busy with other BatchTunings' ticks (here: its one thread held for 4 s) does not hold the verdict."""
    import concurrent.futures
    import threading

    w = world(apply={"mode": "Recommend"}, strategy={"type": "Grid", "maxTrials": 1},
              searchSpace={"maxNumSeqs": {"values": [8]}})
    outcome = waiting_for_the_last_window(w)
    assert outcome.wake_at is not None
    complete = datetime.now(UTC) + timedelta(seconds=1.0)
    install = replace(FAR_LAG, scrape_lag_seconds=(complete - (outcome.wake_at - timedelta(seconds=600))).total_seconds())
    monkeypatch.setattr(handlers, "ports", lambda kwargs: w.ports(install))
    monkeypatch.setattr(handlers, "TICK_SECONDS", 10.0)
    busy = concurrent.futures.ThreadPoolExecutor(1)
    monkeypatch.setattr(handlers, "WORKERS", busy)
    release = threading.Event()
    trial_index = running_trial(w)["index"]
    body = kopf.Body(w.body())
    patch = kopf.Patch()

    async def run() -> float:
        started = time.monotonic()
        timer = asyncio.create_task(handlers.tick(body=body, patch=patch, logger=LOG))
        await asyncio.sleep(0.5)  # its first reconcile ran in kopf's pool and found the window incomplete
        assert not timer.done()
        busy.submit(release.wait, 4.0)  # then every thread of kopf's pool is taken by another tuning's tick
        await timer
        return time.monotonic() - started

    try:
        elapsed = asyncio.run(run())
    finally:
        release.set()
        busy.shutdown()
    assert {t["index"]: t for t in patch["status"]["trials"]}[trial_index]["state"] == "Done"
    assert elapsed < 3.0  # at the wake (1 s), not once kopf's pool is free again (4.5 s)


def running_the_last_run(w: World) -> str:
    """Step the world on the real clock (scrape lag 0) until the run whose reading concludes the trial is going: its
    load Job created and not finished. Its name."""
    w.now = datetime.now(UTC)
    for _ in range(60):
        w.apply(reconcile_outcome(w.tuning(), w.ports(), w.now, LOG).patch)
        going = [name for name, job in w.jobs.items() if not (job.get("status") or {}).get("conditions")]
        if going:
            ahead = copy.deepcopy(w)
            index = running_trial(ahead)["index"]
            ahead.settle()
            ahead.apply(reconcile_outcome(ahead.tuning(), ahead.ports(), datetime.now(UTC), LOG).patch)
            if next(t for t in ahead.status["trials"] if t["index"] == index)["state"] == "Done":
                return going[0]
        w.settle()
    raise AssertionError(f"no run concluded the trial; phase {w.phase}")


def counting_reconciles(monkeypatch) -> list[int]:
    calls: list[int] = []
    reconcile = handlers.reconcile_outcome

    def counted(*args, **kwargs):
        calls.append(1)
        return reconcile(*args, **kwargs)

    monkeypatch.setattr(handlers, "reconcile_outcome", counted)
    return calls


async def the_job_ends(w: World, job_name: str) -> None:
    """The load Job ends, and the Job watch sees it."""
    w.now = datetime.now(UTC)
    w.settle()
    job = w.jobs[job_name]
    await handlers.owned_jobs(namespace=job["metadata"]["namespace"], name=job_name, meta=job["metadata"],
                              status=job["status"])


async def the_pod_ends(w: World, job_name: str) -> None:
    """The load pod ends and the pod watch sees it; the Job controller has not marked the Job Complete."""
    w.now = datetime.now(UTC)
    w.settle()
    assert not w.jobs[job_name]["status"].get("conditions")
    pod = w.pods[f"{job_name}-pod"]
    await handlers.batchtune_pods(namespace=pod["metadata"]["namespace"], body=kopf.Body(pod),
                                  labels=pod["metadata"]["labels"])


def a_run_that_ends(monkeypatch, w: World, job_name: str, tick_s: float, ends_after_s: float,
                    end: Callable[[World, str], Awaitable[None]] = the_job_ends,
                    reconciles_before_the_end: int = 1) -> tuple[kopf.Patch, float]:
    """One timer run (`handlers.tick`) on `w`, whose load run `job_name` ends (`end`) `ends_after_s` into it, with the
    run still waiting then after `reconciles_before_the_end` reconciles: its patch and how long it took."""
    monkeypatch.setattr(handlers, "ports", lambda kwargs: w.ports())
    monkeypatch.setattr(handlers, "TICK_SECONDS", tick_s)
    reconciles = counting_reconciles(monkeypatch)
    body = kopf.Body(w.body())
    patch = kopf.Patch()

    async def run() -> float:
        started = time.monotonic()
        timer = asyncio.create_task(handlers.tick(body=body, patch=patch, logger=LOG))
        await asyncio.sleep(ends_after_s)
        assert not timer.done() and len(reconciles) == reconciles_before_the_end  # it waits for the end
        await end(w, job_name)
        await timer
        return time.monotonic() - started

    return patch, asyncio.run(run())


def verdict(patch: kopf.Patch, index: int) -> str:
    return {t["index"]: t for t in patch["status"]["trials"]}[index]["state"]


def test_the_end_of_a_running_load_run_seen_by_the_job_watch_wakes_the_timer(monkeypatch):
    w = world(**ONE_TRIAL)
    job_name = running_the_last_run(w)
    trial_index = running_trial(w)["index"]
    patch, elapsed = a_run_that_ends(monkeypatch, w, job_name, tick_s=5.0, ends_after_s=0.5)
    assert verdict(patch, trial_index) == "Done"
    assert elapsed < 2.5  # at the Job's end (0.5 s), not on the timer's next run (5 s and after)


def test_a_load_run_that_does_not_end_reconciles_once_a_tick_up_to_the_bound_then_leaves_it_to_the_timer(monkeypatch):
    w = world(apply={"mode": "Recommend"}, strategy={"type": "Grid", "maxTrials": 1},
              searchSpace={"maxNumSeqs": {"values": [8]}})
    running_the_last_run(w)
    monkeypatch.setattr(handlers, "ports", lambda kwargs: w.ports())
    monkeypatch.setattr(handlers, "TICK_SECONDS", 0.5)
    monkeypatch.setattr(handlers, "END_WAITS_PER_RUN", 6)
    reconciles = counting_reconciles(monkeypatch)
    patch = kopf.Patch()
    started = time.monotonic()
    asyncio.run(handlers.tick(body=kopf.Body(w.body()), patch=patch, logger=LOG))
    elapsed = time.monotonic() - started
    # The first, and one in place of each of the timer's next runs, a tick apart, up to the bound (not the window
    # wakes' bound, WAKES_PER_RUN: a load run lasts many ticks).
    assert not patch and len(reconciles) == 1 + 6
    assert 0.5 * 6 <= elapsed < 0.5 * 6 + 1.5


def test_an_end_after_a_tick_of_waiting_is_taken_at_once_not_on_the_timers_next_run(monkeypatch):
    """The load run does not end within the first tick of waiting (the timer's reconcile in its place finds it still
    going), then ends: the verdict is written at its end, not after the run returned and the timer's interval passed."""
    w = world(**ONE_TRIAL)
    job_name = running_the_last_run(w)
    trial_index = running_trial(w)["index"]
    patch, elapsed = a_run_that_ends(monkeypatch, w, job_name, tick_s=1.0, ends_after_s=1.5,
                                     reconciles_before_the_end=2)
    assert verdict(patch, trial_index) == "Done"
    assert elapsed < 1.9  # at the end (1.5 s), not at the second tick's reconcile (2 s) or the timer's next run


# ---- the load pod's end, before the Job controller's -------------------------------------------------------------

ONE_TRIAL = {"apply": {"mode": "Recommend"}, "strategy": {"type": "Grid", "maxTrials": 1},
             "searchSpace": {"maxNumSeqs": {"values": [8]}}}


def test_a_run_is_read_from_its_own_pod_before_the_job_controller_marks_the_job_complete():
    """The load generator's pod has ended with its summary; the Job controller has not marked the Job Complete (on a
    loaded control plane that comes seconds later: docs/benchmarks.md). The run is read, and the tuning ends as it does
    when the Job controller keeps up."""
    honest = world(**ONE_TRIAL)
    honest.run_until({"Recommended"})
    lagging = world(**ONE_TRIAL)
    lagging.job_controller_lag = True  # and it never catches up
    lagging.run_until({"Recommended"})
    assert all(not (job.get("status") or {}).get("conditions") for job in lagging.jobs.values())
    assert len(lagging.load_runs) == len(honest.load_runs)
    assert [(t["state"], t.get("metrics")) for t in lagging.status["trials"]] == \
        [(t["state"], t.get("metrics")) for t in honest.status["trials"]]
    assert lagging.status["recommendation"] == honest.status["recommendation"]


def test_a_pod_the_job_does_not_control_does_not_end_a_run_the_job_has_not():
    """Issue 22's rule holds for the early read: a pod with the Job's labels, ended with a summary, whose controller is
    not the Job (here: none), leaves the run going until the Job's own pod ends."""
    w = world(**ONE_TRIAL)
    job_name = running_the_last_run(w)
    w.job_controller_lag = True
    index = running_trial(w)["index"]
    forged = copy.deepcopy(w)
    forged.run_load_jobs()
    pod = forged.pods.pop(f"{job_name}-pod")
    pod["metadata"]["ownerReferences"] = []
    w.pods[f"{job_name}-forged"] = pod
    w.apply(reconcile_outcome(w.tuning(), w.ports(), datetime.now(UTC), LOG).patch)
    assert running_trial(w)["index"] == index and not w.jobs[job_name].get("status", {}).get("conditions")
    w.run_load_jobs()  # its own pod ends
    w.apply(reconcile_outcome(w.tuning(), w.ports(), datetime.now(UTC), LOG).patch)
    assert next(t for t in w.status["trials"] if t["index"] == index)["state"] == "Done"


def test_the_end_of_a_load_pod_seen_by_the_pod_watch_wakes_the_timer_before_the_job_completes(monkeypatch):
    w = world(**ONE_TRIAL)
    job_name = running_the_last_run(w)
    w.job_controller_lag = True
    trial_index = running_trial(w)["index"]
    job = w.jobs[job_name]
    # The Job watch saw the Job when it was created (not finished): the pod's controller is traced to the tuning.
    asyncio.run(handlers.owned_jobs(namespace=job["metadata"]["namespace"], name=job_name, meta=job["metadata"],
                                    status=job.get("status") or {}))
    patch, elapsed = a_run_that_ends(monkeypatch, w, job_name, tick_s=5.0, ends_after_s=0.5, end=the_pod_ends)
    assert verdict(patch, trial_index) == "Done"
    assert elapsed < 2.5  # at the pod's end (0.5 s), not on the timer's next run (5 s and after)


def test_only_a_pod_traced_through_its_job_to_the_tuning_wakes_it():
    async def run() -> list[bool]:
        ends = handlers.LoadRunEnds()
        woken = ends.listen("tuning-uid")
        seen = []
        ends.pod_ended("job-uid")  # a Job the Job watch has not seen (or another's): nothing
        seen.append(woken.is_set())
        ends.owns("job-uid", "other-tuning", finished=False)
        ends.pod_ended("job-uid")  # another tuning's Job
        seen.append(woken.is_set())
        ends.owns("job-uid-2", "tuning-uid", finished=False)
        ends.pod_ended("job-uid-2")
        seen.append(woken.is_set())
        woken.clear()
        ends.pod_ended("job-uid-2")  # the pod's later events: the Job is forgotten once its pod succeeded
        seen.append(woken.is_set())
        ends.owns("job-uid-3", "tuning-uid", finished=False)
        ends.owns("job-uid-3", "tuning-uid", finished=True)  # the Job finished: woken, and forgotten
        seen.append(woken.is_set())
        woken.clear()
        ends.pod_ended("job-uid-3")
        seen.append(woken.is_set())
        return seen

    assert asyncio.run(run()) == [False, False, True, False, True, False]
