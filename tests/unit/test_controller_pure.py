"""Pure decisions of the operator: failure classification, GitOps detection, load search, conditions."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings, strategies as st

from batchtune.controller.conditions import set_condition
from batchtune.controller.failures import FailureReason, classify_pod, pod_is_ready
from batchtune.controller.gitops import gitops_manager
from batchtune.controller.loadsearch import LoadStep, SearchBounds, capacity, next_load

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def _ts(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod(container_status=None, conditions=None, created=10):
    return {"metadata": {"creationTimestamp": _ts(created)},
            "status": {"conditions": conditions or [], "containerStatuses": [container_status] if container_status else []}}


@pytest.mark.parametrize("pod,expected", [
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}),
                 FailureReason.IMAGE_PULL, id="image-pull"),
    pytest.param(_pod({"name": "vllm", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}),
                 FailureReason.OOM_KILLED, id="oom-killed"),
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                       "lastState": {"terminated": {"exitCode": 1, "message":
                           "Traceback...\nValueError: No available memory for the cache blocks. Try increasing "
                           "`gpu_memory_utilization` when initializing the engine."}}}),
                 FailureReason.KV_CACHE_DOES_NOT_FIT, id="kv-cache-message"),
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                       "lastState": {"terminated": {"exitCode": 1, "message":
                           "ValueError: Free memory on device (70.1/79.1 GiB) on startup is less than desired GPU "
                           "memory utilization (0.95, 75.1 GiB)."}}}),
                 FailureReason.INSUFFICIENT_GPU_MEMORY, id="free-memory-message"),
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                       "lastState": {"terminated": {"exitCode": 2, "message": "bad flag"}}}),
                 FailureReason.CRASH_LOOP, id="crash-loop-other"),
    pytest.param(_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "message": "0/2 nodes are available: 2 node(s) didn't match Pod's node "
                                              "affinity/selector.",
                                   "lastTransitionTime": _ts(120)}]),
                 FailureReason.UNSCHEDULABLE, id="unschedulable-after-grace"),
    pytest.param(_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                                   "lastTransitionTime": _ts(120)}]),
                 None, id="waiting-for-gpus-is-not-a-verdict"),
    pytest.param(_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
                                   "lastTransitionTime": _ts(120)}], created=1000),
                 FailureReason.READINESS_TIMEOUT, id="waiting-for-gpus-until-the-readiness-timeout"),
    pytest.param(_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "lastTransitionTime": _ts(5)}]),
                 None, id="unschedulable-within-grace"),
    pytest.param(_pod({"name": "vllm", "state": {"running": {}}}, created=1000), FailureReason.READINESS_TIMEOUT,
                 id="readiness-timeout"),
    pytest.param(_pod({"name": "vllm", "state": {"running": {}}}, created=10), None, id="still-starting"),
    pytest.param(_pod({"name": "sidecar", "state": {"terminated": {"exitCode": 137}}}), None,
                 id="other-container-ignored"),
])
def test_classify_pod(pod, expected):
    failure = classify_pod(pod, "vllm", NOW, readiness_timeout_s=600)
    assert (failure.reason if failure else None) == expected


def test_classify_quotes_the_last_traceback_line():
    pod = _pod({"name": "vllm", "state": {"terminated": {"exitCode": 1, "message":
                "Traceback (most recent call last):\n  File x\nValueError: No available memory for the cache blocks."}}})
    failure = classify_pod(pod, "vllm", NOW, 600)
    assert failure.message == "ValueError: No available memory for the cache blocks."


def test_pod_ready_requires_ready_condition_and_no_deletion():
    ready = {"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_is_ready(ready)
    assert not pod_is_ready({**ready, "metadata": {"deletionTimestamp": _ts(1)}})
    assert not pod_is_ready({"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}})


@pytest.mark.parametrize("meta,expected", [
    pytest.param({"labels": {"argocd.argoproj.io/instance": "prod"}}, "Argo CD", id="argo-label"),
    pytest.param({"annotations": {"argocd.argoproj.io/tracking-id": "a:apps/Deployment:ns/x"}}, "Argo CD",
                 id="argo-tracking-id"),
    pytest.param({"labels": {"kustomize.toolkit.fluxcd.io/name": "apps"}}, "Flux", id="flux-kustomize"),
    pytest.param({"labels": {"helm.toolkit.fluxcd.io/name": "vllm"}}, "Flux", id="flux-helm"),
    pytest.param({"labels": {"app": "vllm"}}, None, id="plain"),
])
def test_gitops_manager(meta, expected):
    assert gitops_manager({"metadata": meta}) == expected


def _run_search(capacity_true: int, start: int, max_steps: int = 8) -> list[LoadStep]:
    """Drives the search against a synthetic trial whose margin falls linearly with load."""
    steps: list[LoadStep] = []
    bounds = SearchBounds(start=start, highest=4096, max_steps=max_steps)
    while (load := next_load(steps, bounds)) is not None:
        margin = (capacity_true - load) / capacity_true
        steps.append(LoadStep(load=load, passed=margin >= 0, margin=margin, throughput=float(load)))
    return steps


@pytest.mark.parametrize("true_capacity,start", [
    pytest.param(100, 16, id="bracket-up"), pytest.param(100, 512, id="bracket-down"),
    pytest.param(37, 37, id="exact-start"), pytest.param(3000, 64, id="far-up"),
])
def test_load_search_brackets_then_interpolates(true_capacity, start):
    steps = _run_search(true_capacity, start)
    found = capacity(steps)
    assert found is not None
    assert found.load <= true_capacity
    assert found.load >= 0.85 * true_capacity or len(steps) == 8
    assert len({s.load for s in steps}) == len(steps), "no load is run twice"


def test_load_search_beats_linear_stepping():
    steps = _run_search(200, 16)
    assert len(steps) <= 6  # linear stepping by 16 would take 12 runs


def test_load_search_nothing_passes():
    steps = _run_search(0.5, 8)
    assert capacity(steps) is None
    assert min(s.load for s in steps) == 1


@settings(max_examples=200, deadline=None)
@given(true_capacity=st.integers(1, 2000), start=st.integers(1, 2000))
def test_load_search_never_reports_a_failing_load(true_capacity, start):
    steps = _run_search(true_capacity, start, max_steps=5)
    found = capacity(steps)
    assert found is None or found.load <= true_capacity
    assert len(steps) <= 5


def test_condition_transition_time_moves_only_on_flip():
    first = set_condition([], "Progressing", True, "Planned", "m", 1, NOW)
    later = NOW + timedelta(minutes=5)
    same = set_condition(first, "Progressing", True, "Trialing", "m2", 2, later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    assert same[0]["reason"] == "Trialing" and same[0]["observedGeneration"] == 2
    flipped = set_condition(same, "Progressing", False, "Done", "m3", 2, later)
    assert flipped[0]["lastTransitionTime"] != first[0]["lastTransitionTime"]
