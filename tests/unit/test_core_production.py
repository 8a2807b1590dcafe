"""What batchtune did to production, recorded on the Deployment: the applied mark and the rollback decision."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from batchtune.core.production import (
    ANNOTATION_APPLIED,
    AppliedMark,
    MarkState,
    Restore,
    args_patch,
    rollback_decision,
)
from batchtune.core.recommend import ContainerArgs

AT = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
PREVIOUS = ContainerArgs(("vllm", "serve"), ("m", "--max-num-seqs", "256"))
APPLIED = ContainerArgs(("vllm", "serve"), ("m", "--max-num-seqs", "64"))
MARK = AppliedMark("bt", "uid-1", 3, "vllm", PREVIOUS, APPLIED, AT)


def _deployment(mark: AppliedMark | str | None, running: ContainerArgs = APPLIED, container: str = "vllm") -> dict:
    annotations = {} if mark is None else {ANNOTATION_APPLIED: mark if isinstance(mark, str) else mark.to_annotation()}
    return {"metadata": {"name": "llm", "annotations": annotations},
            "spec": {"template": {"spec": {"containers": [{"name": "proxy", "command": ["envoy"]},
                                                          {"name": container, **running.to_wire()}]}}}}


@pytest.mark.parametrize("mark", [
    pytest.param(MARK, id="applied"),
    pytest.param(MARK.with_state(MarkState.VERIFIED), id="verified"),
    pytest.param(AppliedMark("bt", "u", 0, "c", ContainerArgs(None, ("a",)), ContainerArgs(("x",), None), AT, MarkState.KEPT),
                 id="command-or-args-only"),
])
def test_applied_mark_round_trips_through_the_annotation(mark):
    assert AppliedMark.read(_deployment(mark)) == mark


def _edited(**changes) -> str:
    data = json.loads(MARK.to_annotation())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return json.dumps(data)


@pytest.mark.parametrize("text", [
    pytest.param("not json", id="not-json"),
    pytest.param("[]", id="not-an-object"),
    pytest.param(_edited(uid=None), id="uid-missing"),
    pytest.param(_edited(generation="three"), id="generation-not-a-number"),
    pytest.param(_edited(state="Sleeping"), id="unknown-state"),
    pytest.param(_edited(appliedAt="yesterday"), id="bad-time"),
    pytest.param(_edited(previous={"args": "m"}), id="args-not-a-list"),
    pytest.param(_edited(previous={"args": [1, 2]}), id="args-not-strings"),
    pytest.param(_edited(applied=["vllm"]), id="applied-not-an-object"),
])
def test_malformed_annotation_reads_as_none(text):
    assert AppliedMark.read(_deployment(text)) is None


def test_no_annotation_reads_as_none():
    assert AppliedMark.read(_deployment(None)) is None
    assert AppliedMark.read({}) is None


@pytest.mark.parametrize("deployment, uid, status_previous, decision", [
    pytest.param(_deployment(MARK), "uid-1", PREVIOUS, Restore.RESTORE, id="restore"),
    pytest.param(_deployment(MARK), "uid-1", None, Restore.RESTORE, id="restore-without-status"),
    pytest.param(_deployment(MARK, running=ContainerArgs(("vllm", "serve"), ("m", "--max-num-seqs", "32"))), "uid-1", PREVIOUS,
                 Restore.CHANGED_BY_OTHERS, id="someone-edited-the-args"),
    pytest.param(_deployment(MARK, container="engine"), "uid-1", PREVIOUS, Restore.CHANGED_BY_OTHERS, id="container-gone"),
    pytest.param(_deployment(None), "uid-1", PREVIOUS, Restore.NOTHING, id="no-mark"),
    pytest.param(_deployment("garbage"), "uid-1", PREVIOUS, Restore.NOTHING, id="unreadable-mark"),
    pytest.param(_deployment(MARK), "uid-2", PREVIOUS, Restore.NOTHING, id="another-tunings-mark"),
    pytest.param(_deployment(MARK.with_state(MarkState.VERIFIED)), "uid-1", PREVIOUS, Restore.NOTHING, id="already-verified"),
    pytest.param(_deployment(MARK.with_state(MarkState.ROLLED_BACK)), "uid-1", PREVIOUS, Restore.NOTHING, id="already-rolled-back"),
    pytest.param(_deployment(MARK), "uid-1", ContainerArgs(("vllm", "serve"), ("m",)), Restore.DISAGREES,
                 id="status-and-annotation-disagree"),
])
def test_rollback_decision(deployment, uid, status_previous, decision):
    got, mark = rollback_decision(deployment, uid, status_previous)
    assert got is decision
    if decision is not Restore.NOTHING:
        assert mark == MARK


def test_args_patch_is_guarded_by_the_resource_version():
    body = args_patch("vllm", ContainerArgs(None, ("m",)), {ANNOTATION_APPLIED: "x", "other": None}, "42")
    assert body["metadata"] == {"resourceVersion": "42", "annotations": {ANNOTATION_APPLIED: "x", "other": None}}
    assert body["spec"]["template"]["spec"]["containers"] == [{"name": "vllm", "command": None, "args": ["m"]}]
