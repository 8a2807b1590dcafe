"""A finished trial keeps its conclusion and a few load steps; only a running trial keeps every step (issue 22, 9).

Status holds every step of a trial while it runs: the trial loop (`core.trial_loop`) decides on them. Once the trial
is finished its conclusion stands, so it keeps at most `KEPT_STEPS` closed steps (the report's curve point, the step
its capacity was measured at, the first or the one at the twin's prediction, where the SLO broke) without their
per-run bookkeeping, and the bench's search learns from those same steps.
"""

from __future__ import annotations

import api_crd
import pytest
from fake_world import LOCAL_PROMETHEUS, fresh_backoff, world  # noqa: F401  # the fixture, through pytestmark

from batchtune.api import steps_on_the_wire
from batchtune.controller.ports import Install
from batchtune.core.protocol import StepResult
from batchtune.core.trial_loop import KEPT_STEPS, Step, kept
from batchtune.core.vocabulary import StepPurpose, Verdict

pytestmark = pytest.mark.usefixtures("fresh_backoff")
TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
FAST_SCRAPES = Install(
    operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0, scrape_interval_seconds=2
)


def closed(load: int, verdict: Verdict, purpose: StepPurpose | None = None) -> Step:
    result = StepResult(
        load,
        {"requestThroughput": float(load)},
        verdict,
        "",
        0.1 if verdict is Verdict.MET else -0.1,
        None,
        purpose is not StepPurpose.BRACKET,
    )
    return Step(load, purpose, result=result)


def test_kept_holds_the_curve_point_the_capacity_the_first_step_and_where_the_slo_broke():
    b, met, bad = StepPurpose.BRACKET, Verdict.MET, Verdict.VIOLATED
    steps = [
        closed(8, met, b),
        closed(16, met, b),
        closed(32, met, b),
        closed(64, bad, b),
        closed(48, bad, b),
        closed(40, met, b),
        closed(44, bad, b),
        closed(40, met),
        closed(24, met, StepPurpose.CURVE),
    ]
    keep = kept(steps, curve_step=8, capacity_load=40, predicted=None)
    assert len(keep) == KEPT_STEPS
    # The curve point, the full window at the capacity, the first step, the lowest failing load above it (44).
    assert keep == (0, 6, 7, 8)


def test_kept_prefers_the_step_at_the_twins_prediction_and_never_an_open_step():
    steps = [
        closed(32, Verdict.MET),
        closed(64, Verdict.MET),
        closed(128, Verdict.VIOLATED),
        closed(96, Verdict.MET),
        Step(112),
    ]
    assert kept(steps, curve_step=None, capacity_load=96, predicted=64) == (0, 1, 2, 3)
    assert 4 not in kept(steps, None, 96, None)
    assert kept(steps[:2], None, 64, None) == (0, 1)


def test_a_finished_trial_is_compacted_and_a_running_one_keeps_every_step():
    w = world(searchSpace={"maxNumSeqs": {"values": [64]}}, strategy={"type": "Grid", "maxTrials": 1})
    most_while_running = 0
    for _ in range(400):
        if w.phase in TERMINAL:
            break
        w.tick(FAST_SCRAPES)
        for trial in w.status.get("trials") or []:
            if trial["state"] not in ("Done", "Infeasible", "Failed"):
                # On the wire a running trial's steps are its record in status.running, never on the trial.
                assert "steps" not in trial
                most_while_running = max(most_while_running, len(steps_on_the_wire(w.status, trial)))
    assert w.phase == "Succeeded"
    assert most_while_running > KEPT_STEPS, "the search must take more steps than a finished trial keeps"
    (trial,) = w.status["trials"]
    steps = trial["steps"]
    assert len(steps) == KEPT_STEPS
    assert all("job" not in s and not s.get("results") and s.get("verdict") for s in steps)
    assert steps[trial["curveStep"]]["purpose"] == "Curve" and steps[trial["curveStep"]]["metrics"]
    capacity = [s for s in steps if "purpose" not in s and s["load"] == trial["metrics"]["sloCapacityLoad"]]
    assert capacity and capacity[-1]["verdict"] == "Met"
    # The recommendation and the report still read what they need from the compacted trial.
    assert w.status["recommendation"]["setting"] == trial["setting"]


def test_every_status_a_parallel_tuning_writes_is_one_the_crd_admits_and_the_choice_keeps_its_evidence():
    # Three trials at once, two repeats a step: at every tick the status written (what a restart resumes from) has
    # the running trials' steps in status.running, the open step's runs with them, and passes the CRD's schema.
    w = world(searchSpace={"maxNumSeqs": {"values": [8, 16, 32, 64, 128, 256]}},
              strategy={"type": "Grid", "maxTrials": 6, "maxParallelTrials": 3}, trial={"repeats": 2})
    opened_with_runs = most_running = 0
    for _ in range(600):
        if w.phase in TERMINAL:
            break
        w.tick(FAST_SCRAPES)
        obj = {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": {"name": w.name},
               "spec": w.bt_spec, "status": w.status}
        assert [e for e in api_crd.schema_errors(obj) if e.path.startswith("status")] == []
        running = w.status.get("running") or []
        most_running = max(most_running, len(running))
        opened_with_runs += sum(1 for r in running if (r.get("open") or {}).get("results"))
        assert all(len(t.get("steps") or []) <= KEPT_STEPS for t in w.status.get("trials") or [])
    assert w.phase == "Succeeded"
    assert most_running == 3 and opened_with_runs > 0 and "running" not in w.status
    best = next(t for t in w.status["trials"] if t["name"] == w.status["bestTrial"])
    # The decision's evidence is in status: the chosen trial's figures, verdict and kept steps, its capacity among them.
    assert best["verdict"] == "Met" and best["metrics"]["sloCapacity"] > 0 and best["steps"]
    assert best["metrics"]["sloCapacityLoad"] in [s["load"] for s in best["steps"] if s.get("purpose") != "Curve"]
    assert w.status["recommendation"]["setting"] == best["setting"]
