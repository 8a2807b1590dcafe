"""Status on the wire (issue 22, section 9): a running trial's load steps are a record of their own
(status.running, with the open step's runs and Job once), a finished trial keeps its few closed steps and no run
bookkeeping; a tick still works on `trial.steps`, and a status written before the change is read."""

from __future__ import annotations

from typing import Any

import api_crd
import pytest

from batchtune.api import InvalidBatchTuning, parse_spec, parse_status, steps_on_the_wire
from batchtune.api.models import (
    MAX_PARALLEL_TRIALS_LIMIT,
    MAX_STEPS_IN_STATUS,
    MAX_TRIALS_LIMIT,
    BatchTuningStatus,
    LoadStepRecord,
    RunRecord,
    Setting,
    TrialRecord,
)
from batchtune.controller import status as status_io
from batchtune.core.trial_loop import KEPT_STEPS
from batchtune.core.vocabulary import StepPurpose, TrialState, Verdict

BOOKKEEPING = {"repeat", "attempt", "job", "results", "unavailableSince"}
SETTING = {"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 90}


def _closed(load: int, itl: float, verdict: str = "Met", **extra: Any) -> dict[str, Any]:
    return {"load": load, "metrics": {"itlMs": itl, "outputThroughput": 10.0 * load}, "verdict": verdict,
            "verdictReason": "all met", "margin": 0.2, **extra}


def _trial(index: int, state: str, **extra: Any) -> dict[str, Any]:
    return {"index": index, "name": f"bt-trial-{index}", "setting": SETTING, "state": state, "gpus": 1,
            "startedAt": "2025-01-02T03:00:00Z", **extra}


def _running_trial_in_memory() -> TrialRecord:
    return TrialRecord(
        index=3, name="bt-trial-3", setting=Setting(max_num_seqs=64, gpu_memory_utilization_percent=90),
        state=TrialState.MEASURING, gpus=1,
        steps=[LoadStepRecord(**_closed(8, 20.0), job="bt-load-3-0-0-0"),
               LoadStepRecord(**_closed(32, 60.0, "Violated"), job="bt-load-3-1-0-0", repeat=1),
               LoadStepRecord(load=16, job="bt-load-3-2-1-0", repeat=1,
                              results=[RunRecord(metrics={"itlMs": 41.0}, cross_check="itlMs: apart")])])


def test_the_crd_keeps_a_finished_trials_few_steps_and_the_running_trials_many_apart() -> None:
    # What the schema says, so what the API server holds to: the product of trials x steps x runs is gone.
    status = api_crd.openapi_schema()["properties"]["status"]["properties"]
    kept = status["trials"]["items"]["properties"]["steps"]
    assert kept["maxItems"] == KEPT_STEPS and not BOOKKEEPING & set(kept["items"]["properties"])
    running = status["running"]
    assert running["maxItems"] == MAX_PARALLEL_TRIALS_LIMIT + 1
    assert running["items"]["properties"]["steps"]["maxItems"] == MAX_STEPS_IN_STATUS
    assert not BOOKKEEPING & set(running["items"]["properties"]["steps"]["items"]["properties"])
    assert set(running["items"]["properties"]["open"]["properties"]) >= BOOKKEEPING


def test_a_finished_trial_is_compact_on_the_wire() -> None:
    # Whatever bookkeeping a tick left on a finished trial's steps, none is written.
    trial = TrialRecord(index=0, name="bt-trial-0", setting=Setting(max_num_seqs=64, gpu_memory_utilization_percent=90),
                        state=TrialState.DONE, steps=[LoadStepRecord(**_closed(8, 20.0), job="j", repeat=2, attempt=1,
                                                                     results=[RunRecord(metrics={"itlMs": 1.0})])])
    wire = BatchTuningStatus(trials=[trial]).to_wire()
    assert wire["trials"][0]["steps"] == [{**_closed(8, 20.0), "lengthened": 0}]
    assert "running" not in wire
    assert api_crd.schema_errors({"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
                                  "metadata": {"name": "bt"}, "spec": _spec(), "status": wire}) == []


def test_a_running_trials_steps_are_apart_with_its_open_step_and_come_back_whole() -> None:
    status = BatchTuningStatus(trials=[TrialRecord.model_validate(_trial(0, "Done", steps=[_closed(8, 20.0)])),
                                       _running_trial_in_memory()])
    wire = status.to_wire()
    assert "steps" not in wire["trials"][1]
    (entry,) = wire["running"]
    assert entry["index"] == 3 and [s["load"] for s in entry["steps"]] == [8, 32, 16]
    assert all(not BOOKKEEPING & set(s) for s in entry["steps"])  # a closed step's Job is garbage: not kept
    assert entry["open"] == {"step": 2, "repeat": 1, "attempt": 0, "job": "bt-load-3-2-1-0",
                             "results": [{"metrics": {"itlMs": 41.0}, "crossCheck": "itlMs: apart"}]}
    back = parse_status(wire)
    assert back.running == []
    assert back.trials[1].steps[2] == status.trials[1].steps[2]  # the open step: its runs and Job, as the tick had them
    assert [s.verdict for s in back.trials[1].steps] == [Verdict.MET, Verdict.VIOLATED, None]
    assert back.to_wire() == wire


def test_a_running_trial_between_steps_has_no_open_record() -> None:
    trial = _running_trial_in_memory()
    trial.steps = trial.steps[:2]
    (entry,) = BatchTuningStatus(trials=[trial]).to_wire()["running"]
    assert "open" not in entry and len(entry["steps"]) == 2


def test_a_status_written_before_the_change_is_read_and_written_in_the_new_shape() -> None:
    # The previous schema kept a running trial's steps, runs and Jobs on the trial itself.
    old = {"phase": "Trialing", "trialsPlanned": 4, "nextTrialIndex": 2,
           "trials": [_trial(0, "Done", verdict="Met", steps=[_closed(8, 20.0, job="bt-load-0-0-0-0")]),
                      _trial(1, "Measuring", steps=[
                          _closed(8, 20.0, job="bt-load-1-0-0-0", repeat=0, attempt=0, results=[]),
                          {"load": 16, "job": "bt-load-1-1-0-0", "repeat": 0, "attempt": 1,
                           "results": [{"metrics": {"itlMs": 30.0}}], "purpose": StepPurpose.BRACKET.value}])]}
    status, problem = status_io.read(old)
    assert problem is None
    assert status.trials[1].steps[1].job == "bt-load-1-1-0-0" and status.trials[1].steps[1].attempt == 1
    assert status.trials[1].steps[1].results[0].metrics == {"itlMs": 30.0}
    wire = status_io.wire(status)
    assert wire["running"] == [{"index": 1, "steps": [{**_closed(8, 20.0), "lengthened": 0},
                                                      {"load": 16, "lengthened": 0, "purpose": "Bracket"}],
                                "open": {"step": 1, "repeat": 0, "attempt": 1, "job": "bt-load-1-1-0-0",
                                         "results": [{"metrics": {"itlMs": 30.0}}]}}]
    assert wire["trials"][0]["steps"] == [{**_closed(8, 20.0), "lengthened": 0}]
    again = status_io.read(wire)[0]
    assert again.trials[1].steps[1] == status.trials[1].steps[1] and status_io.wire(again) == wire


def test_a_finished_trial_with_more_steps_than_the_crd_keeps_is_compacted_on_read() -> None:
    # Written by hand (or by a status writer): the API server would refuse every later status write with it.
    steps = [_closed(load, 10.0 + load, "Met" if load < 40 else "Violated") for load in (8, 16, 24, 32, 40, 48)]
    raw = {"trials": [_trial(0, "Done", verdict="Met", metrics={"itlMs": 42.0, "sloCapacityLoad": 32.0},
                             steps=steps)]}
    status, problem = status_io.read(raw)
    assert problem is None and 0 < len(status.trials[0].steps) <= KEPT_STEPS
    assert 32 in [s.load for s in status.trials[0].steps]  # the capacity step stays: the trial's evidence
    assert api_crd.schema_errors({"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
                                  "metadata": {"name": "bt"}, "spec": _spec(),
                                  "status": status_io.wire(status)}) == []


@pytest.mark.parametrize("running, field, value", [
    pytest.param([{"index": 9, "steps": [_closed(8, 20.0)]}], "status.running[0].index", "9", id="no-such-trial"),
    pytest.param([{"index": 0, "steps": [_closed(8, 20.0)]}], "status.running[0].index", "0", id="a-finished-trial"),
    pytest.param([{"index": 1, "steps": [_closed(8, 20.0)]}, {"index": 1, "steps": []}], "status.running[1].index", "1",
                 id="a-trial-named-twice"),
    pytest.param([{"index": 1, "steps": [_closed(8, 20.0)], "open": {"step": 1}}], "status.running[0].open.step", "1",
                 id="open-step-past-the-steps"),
    pytest.param([{"index": 1, "steps": [_closed(8, 20.0)], "open": {"step": 0}}], "status.running[0].open.step", "0",
                 id="open-step-already-judged"),
])
def test_a_running_record_that_fits_no_running_trial_is_refused_naming_it(running: list[dict[str, Any]], field: str,
                                                                           value: str) -> None:
    raw = {"trials": [_trial(0, "Done", steps=[]), _trial(1, "Measuring")], "running": running}
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_status(raw)
    assert field in str(caught.value) and value in str(caught.value)


def _spec(**strategy: Any) -> dict[str, Any]:
    return {"targetRef": {"name": "llama"}, "searchSpace": {"maxNumSeqs": {"min": 8, "max": 64}},
            "slo": {"interTokenLatencyMilliseconds": 50}, "prometheus": {"url": "http://prometheus.monitoring:9090"},
            **({"strategy": strategy} if strategy else {})}


def test_max_trials_above_what_status_keeps_is_refused_naming_the_field_and_value() -> None:
    assert parse_spec(_spec(maxTrials=MAX_TRIALS_LIMIT)).strategy.max_trials == MAX_TRIALS_LIMIT
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_spec(_spec(maxTrials=MAX_TRIALS_LIMIT + 1))
    assert "spec.strategy.maxTrials" in str(caught.value) and str(MAX_TRIALS_LIMIT + 1) in str(caught.value)
    errors = api_crd.schema_errors({"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning",
                                    "metadata": {"name": "bt"}, "spec": _spec(maxTrials=MAX_TRIALS_LIMIT + 1)})
    assert [e.path for e in errors] == ["spec.strategy.maxTrials"]


def test_a_wire_reader_finds_every_trials_steps_where_status_keeps_them() -> None:
    # What scripts and integration tests read from the API server's copy (steps_on_the_wire).
    status = BatchTuningStatus(trials=[TrialRecord.model_validate(_trial(0, "Done", steps=[_closed(8, 20.0)])),
                                       _running_trial_in_memory()])
    wire = status.to_wire()
    assert steps_on_the_wire(wire, wire["trials"][0]) == wire["trials"][0]["steps"]
    running = steps_on_the_wire(wire, wire["trials"][1])
    assert [s["load"] for s in running] == [8, 32, 16] and running[2]["job"] == "bt-load-3-2-1-0"
    assert [s.get("job") for s in running[:2]] == [None, None] and running[2]["results"][0]["metrics"] == {"itlMs": 41.0}
