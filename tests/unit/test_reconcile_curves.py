"""The common curve load: one extra step per trial, for the report's curves, never part of the decision.

Driven through `controller.reconcile` against the in-memory world of `fake_world`, like test_reconcile.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from fake_world import LOCAL_PROMETHEUS, World, reset_backoff, world

from batchtune.api import steps_on_the_wire
from batchtune.controller.ports import Install

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}


@pytest.fixture(autouse=True)
def _fresh_backoff():
    reset_backoff()
    yield
    reset_backoff()


def curve_steps(trial: dict, status: dict | None = None) -> list[dict]:
    """The trial's curve steps; with `status`, a running trial's too (they are in status.running)."""
    steps = steps_on_the_wire(status, trial) if status is not None else trial.get("steps") or []
    return [s for s in steps if s.get("purpose") == "Curve"]


def decision(w: World) -> tuple:
    """What the search concluded: per trial its metrics and verdict, and the choice."""
    trials = [(t["name"], t["state"], t.get("verdict"), t.get("metrics")) for t in w.status["trials"]]
    return trials, w.status.get("bestTrial"), w.status["recommendation"]["setting"]


def load_job_args(w: World) -> dict[str, list[str]]:
    return {name: job["spec"]["template"]["spec"]["containers"][0]["args"] for name, job in w.jobs.items()}


def test_every_trial_is_also_measured_at_production_peak_and_the_decision_ignores_it():
    off = world(report={"curveLoad": {"type": "Off"}})
    assert off.run_until(TERMINAL) == "Succeeded"
    w = world()
    assert w.run_until(TERMINAL) == "Succeeded"
    # Production's peak (10 req/s on its one ready replica) as an open loop, fixed at planning.
    curve = w.status["plan"]["curveLoad"]
    assert curve["requestsPerMinute"] == 600 and "concurrency" not in curve
    assert "production's peak" in curve["source"] and "1 ready replica" in curve["source"]
    for trial in w.status["trials"]:
        steps = curve_steps(trial)
        assert [s["load"] for s in steps] == [600], trial["name"]
        assert trial["steps"][-1] is steps[0] or trial["steps"][-1] == steps[0]  # after the search
        assert trial["curveStep"] == len(trial["steps"]) - 1
        assert steps[0]["metrics"] and steps[0]["verdict"] in ("Met", "Violated", "Unknown")
    # The extra step changes nothing the search concluded: same trials, metrics, verdicts and choice.
    assert decision(w) == decision(off)
    assert "curveLoad" not in off.status["plan"]
    assert not any(curve_steps(t) for t in off.status["trials"])
    assert all("curveStep" not in t for t in off.status["trials"])


def test_the_curve_step_runs_its_own_kind_of_loop():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    created_args: list[list[str]] = []
    for _ in range(200):
        w.tick()
        created_args.extend(a for n, a in load_job_args(w).items() if a not in created_args)
        if w.phase in TERMINAL:
            break
    rates = [a for a in created_args if "--request-rate" in a]
    closed = [a for a in created_args if "--concurrency" in a]
    assert len(rates) == 1 and float(rates[0][rates[0].index("--request-rate") + 1]) == 10  # 600/min
    assert closed, "the SLO-capacity search runs a closed loop"


def test_a_search_step_at_the_common_load_is_reused_not_run_again():
    w = world(objective={"type": "OutputThroughput"}, load={"concurrency": 32},
              report={"curveLoad": {"concurrency": 32}})
    assert w.run_until(TERMINAL) == "Succeeded"
    assert w.status["plan"]["curveLoad"] == {"concurrency": 32, "source": "spec.report.curveLoad.concurrency"}
    for trial in w.status["trials"]:
        assert [s["load"] for s in trial["steps"]] == [32] and not curve_steps(trial)
        assert trial["curveStep"] == 0


def test_concurrency_without_a_number_is_the_largest_batch_planned():
    w = world(report={"curveLoad": {"type": "Concurrency"}})
    assert w.run_until(TERMINAL) == "Succeeded"
    assert w.status["plan"]["curveLoad"]["concurrency"] == 64
    assert {s["load"] for t in w.status["trials"] for s in curve_steps(t)} == {64}


def test_unknown_production_peak_falls_back_to_the_largest_batch_and_says_why():
    w = world()
    w.production_peak_per_second = None
    assert w.run_until(TERMINAL) == "Succeeded"
    curve = w.status["plan"]["curveLoad"]
    assert curve["concurrency"] == 64 and "peak request rate is unknown" in curve["source"]


def test_a_production_too_quiet_for_a_percentile_falls_back_too():
    w = world()
    w.production_peak_per_second = 0.5  # 30/min: 15 requests in a 30 s window, under the 20 a percentile needs
    assert w.run_until(TERMINAL) == "Succeeded"
    curve = w.status["plan"]["curveLoad"]
    assert curve["concurrency"] == 64 and "fewer than 20 requests" in curve["source"]


def test_an_unmeasurable_curve_step_leaves_the_trial_done_with_its_search_conclusion():
    off = world(report={"curveLoad": {"type": "Off"}})
    off.run_until(TERMINAL)
    w = world()
    w.failing_loads = {600}
    assert w.run_until(TERMINAL) == "Succeeded"
    for trial in w.status["trials"]:
        steps = curve_steps(trial)
        assert len(steps) == 1 and steps[0]["verdict"] == "Unknown" and "metrics" not in steps[0]
        assert steps[0]["verdictReason"].startswith("not measured at the common load: LoadGeneratorFailed")
        assert "curveStep" not in trial
    assert decision(w) == decision(off)


def test_a_pod_lost_at_the_common_load_does_not_fail_the_measured_trial():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    for _ in range(200):
        w.tick()
        trial = (w.status.get("trials") or [{}])[0]
        pending = [s for s in curve_steps(trial, w.status) if "verdict" not in s and s.get("job")]
        if pending and pending[0]["job"] in w.jobs:
            break
    else:
        raise AssertionError("the curve step never started")
    pod = next(iter(p for n, p in w.pods.items() if n.startswith("tune-trial-0")))
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    pod["status"]["containerStatuses"] = [{"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                           "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
    w.auto_ready = False
    w.tick(settle=False)
    trial = w.status["trials"][0]
    assert trial["state"] == "Done" and trial["verdict"] == "Met", trial
    reason = curve_steps(trial)[0]["verdictReason"]
    assert reason.startswith("not measured at the common load: the trial pod failed at the common load: OOMKilled")


def test_the_gpu_budget_running_out_during_the_curve_step_keeps_the_trial():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    for _ in range(200):
        w.tick()
        trial = (w.status.get("trials") or [{}])[0]
        if any("verdict" not in s for s in curve_steps(trial, w.status)):
            break
    else:
        raise AssertionError("the curve step never started")
    w.now += timedelta(minutes=5)
    w.tick(Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0, max_gpu_minutes=1))
    trial = w.status["trials"][0]
    assert trial["state"] == "Done" and trial["verdict"] == "Met"
    assert "GpuBudgetExhausted" in curve_steps(trial)[0]["verdictReason"]


def test_the_report_is_written_at_the_decision_and_again_once_production_has_spoken():
    reports = []

    class Reports:
        def submit(self, namespace, name, uid, spec, status):
            reports.append(status["phase"])

    w = world()
    ports = w.ports

    def with_reports(install=None):
        p = ports(install)
        p.reports = Reports()
        return p

    w.ports = with_reports
    assert w.run_until(TERMINAL) == "Succeeded"
    assert reports == ["Applying", "Succeeded"]
    w.tick()
    assert reports == ["Applying", "Succeeded"]  # a terminal tuning is not written again
    recommended = world(apply={"mode": "Recommend"})
    recommended.ports = lambda install=None, _p=recommended.ports: _with(_p(install), Reports())
    reports.clear()
    assert recommended.run_until(TERMINAL) == "Recommended" and reports == ["Recommended"]


def _with(ports, reports):
    ports.reports = reports
    return ports


def test_repeats_are_for_the_search_the_curve_step_runs_once():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, trial={"repeats": 2})
    assert w.run_until(TERMINAL) == "Succeeded"
    jobs = [c for c in w.created if c.startswith("Job/")]
    # By the Jobs' names (…-s<step>r<repeat>a<attempt>): a finished trial keeps only a few of its steps in status.
    repeats: dict[int, set[int]] = {}
    for job in jobs:
        found = re.search(r"-s(\d+)r(\d+)a\d+$", job)
        assert found, job
        repeats.setdefault(int(found[1]), set()).add(int(found[2]))
    *searched, curve = sorted(repeats)
    assert searched and all(repeats[s] == {0, 1} for s in searched) and repeats[curve] == {0}
    trial = w.status["trials"][0]
    assert trial["steps"][trial["curveStep"]]["purpose"] == "Curve"
