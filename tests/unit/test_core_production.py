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
    fingerprint,
    rollback_decision,
    rollout_complete,
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
    pytest.param(_edited(applied={"command": "vllm serve"}), id="command-not-a-list"),
    pytest.param(_edited(applied={"command": ["vllm", 1]}), id="command-not-strings"),
    # Longer than status keeps (core.recommend.MAX_COMMAND_LINE_*): batchtune never writes such a mark.
    pytest.param(_edited(previous={"args": ["m"] * 65}), id="args-over-the-word-bound"),
    pytest.param(_edited(applied={"command": ["vllm", "x" * 4093]}), id="a-command-line-over-the-character-bound"),
    pytest.param(_edited(applied={"command": ["vllm", "x" * 4097]}), id="a-word-over-the-length-bound"),
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


def test_the_annotation_is_canonical_json():
    # Sorted keys, no spaces: the same mark always writes the same annotation (no spurious patch).
    text = MARK.to_annotation()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert text.startswith('{"applied":{"args":["m","--max-num-seqs","64"],"command":["vllm","serve"]},"appliedAt":')


def test_a_mark_without_a_state_is_applied():
    # Marks written before the state field existed are unverified changes.
    assert AppliedMark.read(_deployment(_edited(state=None))) == MARK


def test_args_patch_removes_what_is_unset():
    body = args_patch("vllm", ContainerArgs(("vllm", "serve"), None), {}, "7")
    assert body["spec"]["template"]["spec"]["containers"] == [{"name": "vllm", "command": ["vllm", "serve"], "args": None}]


ENGINE = {"name": "vllm", "image": "vllm/vllm-openai:v0.8", "command": ["vllm", "serve"], "args": ["m"],
          "env": [{"name": "HF_HOME", "value": "/cache"}], "envFrom": [{"secretRef": {"name": "hf"}}],
          "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}},
          "volumeMounts": [{"name": "cache", "mountPath": "/cache"}], "ports": [{"containerPort": 8000}]}


def test_fingerprint_is_stable_across_releases():
    # Status keeps the fingerprint of the production container the trials cloned: a new operator must hash alike.
    assert fingerprint(ENGINE) == "28a9e051b559443d"


def test_fingerprint_ignores_key_order_and_what_a_trial_does_not_clone():
    reordered = {k: ENGINE[k] for k in reversed(list(ENGINE))}
    reordered["resources"] = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"memory": "16Gi", "cpu": "4"}}
    assert fingerprint(reordered) == fingerprint(ENGINE)
    assert fingerprint({**ENGINE, "name": "engine", "ports": [], "readinessProbe": {"httpGet": {"port": 8000}}}) == fingerprint(ENGINE)


@pytest.mark.parametrize("key, value", [
    ("image", "vllm/vllm-openai:v0.9"), ("command", ["python", "-m", "vllm"]), ("args", ["m2"]),
    ("env", [{"name": "HF_HOME", "value": "/other"}]), ("envFrom", []), ("resources", {"limits": {"nvidia.com/gpu": "2"}}),
    ("volumeMounts", []),
])
def test_fingerprint_changes_with_what_a_trial_clones(key, value):
    assert fingerprint({**ENGINE, key: value}) != fingerprint(ENGINE)


def _rolled(replicas=2, generation=3, **status) -> dict:
    full = {"observedGeneration": 3, "updatedReplicas": 2, "availableReplicas": 2, "replicas": 2}
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas}, "status": {**full, **status}}


@pytest.mark.parametrize("deployment, complete", [
    pytest.param(_rolled(), True, id="complete"),
    pytest.param(_rolled(availableReplicas=3), True, id="more-available-than-asked"),
    pytest.param(_rolled(observedGeneration=2), False, id="controller-has-not-seen-the-change"),
    pytest.param(_rolled(updatedReplicas=1), False, id="not-all-updated"),
    pytest.param(_rolled(availableReplicas=1), False, id="not-all-available"),
    pytest.param(_rolled(replicas=1, updatedReplicas=1, availableReplicas=1), False, id="an-old-pod-still-runs"),
    pytest.param({"metadata": {"generation": 1}, "spec": {},
                  "status": {"observedGeneration": 1, "updatedReplicas": 1, "availableReplicas": 1, "replicas": 1}},
                 True, id="replicas-default-to-one"),
    pytest.param({"metadata": {"generation": 1}, "spec": {},
                  "status": {"updatedReplicas": 1, "availableReplicas": 1, "replicas": 1}}, False, id="never-observed"),
    pytest.param({"metadata": {"generation": 1}, "spec": {}, "status": {"observedGeneration": 1, "updatedReplicas": 1, "replicas": 1}},
                 False, id="none-available-yet"),
    pytest.param({"metadata": {"generation": 1}, "spec": {}, "status": {}}, False, id="no-status-yet"),
    pytest.param({"spec": {"replicas": 0}}, True, id="scaled-to-zero"),
    pytest.param({"metadata": {"generation": 2}, "spec": {"replicas": 0}, "status": {"observedGeneration": 2}}, True,
                 id="scaled-to-zero-and-observed"),
])
def test_rollout_complete(deployment, complete):
    assert rollout_complete(deployment) is complete
