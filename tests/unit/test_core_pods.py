"""Why a trial pod did not become ready: pod status and the engine's own failure texts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from batchtune.core.pods import (
    TrialFailure,
    classify_pod,
    load_message,
    load_run_outcome,
    log_wanted,
    owned_trial_pods,
    pod_is_ready,
)
from batchtune.core.vocabulary import Reason
from batchtune.engines import VLLM

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _ts(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod(container_status=None, conditions=None, created=10):
    return {"metadata": {"creationTimestamp": _ts(created)},
            "status": {"conditions": conditions or [], "containerStatuses": [container_status] if container_status else []}}


def _crashed(message: str, exit_code: int = 1):
    return _pod({"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                 "lastState": {"terminated": {"exitCode": exit_code, "message": message}}})


def _unschedulable(message: str | None, since: float, created: float = 10):
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": _ts(since)}
    if message is not None:
        condition["message"] = message
    return _pod(conditions=[condition], created=created)


KV = ("Traceback...\nValueError: No available memory for the cache blocks. Try increasing "
      "`gpu_memory_utilization` when initializing the engine.")
GMU = ("ValueError: Free memory on device (70.1/79.1 GiB) on startup is less than desired GPU "
       "memory utilization (0.95, 75.1 GiB).")


@pytest.mark.parametrize("pod, expected", [
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}),
                 Reason.IMAGE_PULL_BACK_OFF, id="image-pull"),
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "ErrImagePull"}}}), Reason.IMAGE_PULL_BACK_OFF,
                 id="err-image-pull"),
    pytest.param(_pod({"name": "vllm", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}),
                 Reason.OOM_KILLED, id="oom-killed"),
    pytest.param(_pod({"name": "vllm", "state": {"terminated": {"exitCode": 137}}}), Reason.OOM_KILLED, id="exit-137"),
    pytest.param(_crashed(KV), Reason.KV_CACHE_TOO_SMALL, id="kv-cache-message"),
    pytest.param(_crashed("ValueError: To serve at least one request with the models's max seq len (32768), (4.0 GiB KV "
                          "cache is needed, which is larger than the available KV cache memory (2.1 GiB)."),
                 Reason.KV_CACHE_TOO_SMALL, id="kv-cache-max-seq-len"),
    pytest.param(_crashed(GMU), Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, id="free-memory-message"),
    pytest.param(_crashed("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."),
                 Reason.OUT_OF_MEMORY, id="cuda-out-of-memory"),
    pytest.param(_crashed("ValueError: max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)."),
                 Reason.ENGINE_REFUSED_ARGS, id="engine-invariant"),
    pytest.param(_crashed("vllm serve: error: unrecognized arguments: --bogus", exit_code=2),
                 Reason.ENGINE_REFUSED_ARGS, id="unrecognized-arguments"),
    pytest.param(_crashed("vllm serve: error: ambiguous option: --max-num could match --max-num-seqs, "
                          "--max-num-batched-tokens", exit_code=2), Reason.ENGINE_REFUSED_ARGS, id="ambiguous-option"),
    pytest.param(_pod({"name": "vllm", "state": {"terminated": {"exitCode": 1, "message": KV}}}),
                 Reason.KV_CACHE_TOO_SMALL, id="terminated-not-yet-backing-off"),
    pytest.param(_crashed("bad flag", exit_code=2), Reason.CRASH_LOOP_BACK_OFF, id="crash-loop-other"),
    pytest.param(_pod({"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}),
                 Reason.CRASH_LOOP_BACK_OFF, id="crash-loop-without-message"),
    pytest.param(_unschedulable("0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector.", 120),
                 Reason.UNSCHEDULABLE, id="unschedulable-after-grace"),
    pytest.param(_unschedulable("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.", 120),
                 None, id="waiting-for-gpus-is-not-a-verdict"),
    pytest.param(_unschedulable("0/2 nodes are available: 2 Insufficient nvidia.com/gpu.", 120, created=1000),
                 Reason.READINESS_TIMEOUT, id="waiting-for-gpus-until-the-readiness-timeout"),
    pytest.param(_unschedulable(None, 5), None, id="unschedulable-within-grace"),
    pytest.param(_pod({"name": "vllm", "state": {"running": {}}}, created=1000), Reason.READINESS_TIMEOUT,
                 id="readiness-timeout"),
    pytest.param(_pod({"name": "vllm", "state": {"running": {}}}, created=10), None, id="still-starting"),
    pytest.param(_pod({"name": "sidecar", "state": {"terminated": {"exitCode": 137}}}), None,
                 id="other-container-ignored"),
])
def test_classify_pod(pod, expected):
    failure = classify_pod(pod, "vllm", NOW, readiness_timeout_s=600, engine=VLLM)
    assert (failure.reason if failure else None) == expected


@pytest.mark.parametrize("message, line", [
    pytest.param("Traceback (most recent call last):\n  File x\nValueError: No available memory for the cache blocks.",
                 "ValueError: No available memory for the cache blocks.", id="last-line-says-it"),
    pytest.param("Traceback (most recent call last):\n  File x\nValueError: No available memory for the cache blocks.\n\n"
                 "The above exception was the direct cause of the following exception:\n  File y\n"
                 "RuntimeError: Engine core initialization failed. See root cause above.\n",
                 "ValueError: No available memory for the cache blocks.", id="root-cause-above-the-last-line"),
    pytest.param("INFO starting\n" + GMU + "\nRuntimeError: Engine core initialization failed.", GMU,
                 id="gmu-line"),
])
def test_classify_quotes_the_line_that_says_the_reason(message, line):
    pod = _pod({"name": "vllm", "state": {"terminated": {"exitCode": 1, "message": message}}})
    failure = classify_pod(pod, "vllm", NOW, 600, VLLM)
    assert failure is not None and failure.message == line


@pytest.mark.parametrize("pod, message", [
    pytest.param(_crashed("Traceback\n  File x\nSystemExit: 3\n"), "SystemExit: 3", id="crash-quotes-the-last-line"),
    pytest.param(_pod({"name": "vllm", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}),
                 "the vLLM process was killed for using too much memory", id="oom-killed-without-message"),
    pytest.param(_unschedulable("0/2 nodes: taint", 120), "0/2 nodes: taint", id="scheduler-message"),
    pytest.param(_pod({"name": "vllm", "state": {"running": {}}}, created=1000),
                 "not ready after 600s (spec.trial.readinessTimeoutSeconds)", id="timeout-names-the-field"),
])
def test_failure_messages(pod, message):
    failure = classify_pod(pod, "vllm", NOW, 600, VLLM)
    assert isinstance(failure, TrialFailure) and failure.message == message


@pytest.mark.parametrize("created_at, expected", [
    pytest.param(None, Reason.READINESS_TIMEOUT, id="pod-creation-time"),
    pytest.param(_ts(10), None, id="trial-start-is-recent"),
    pytest.param(_ts(601), Reason.READINESS_TIMEOUT, id="trial-start-is-old"),
])
def test_readiness_clock_may_start_at_the_trial(created_at, expected):
    pod = _pod({"name": "vllm", "state": {"running": {}}}, created=1000)
    failure = classify_pod(pod, "vllm", NOW, 600, VLLM, created_at=created_at)
    assert (failure.reason if failure else None) == expected


@pytest.mark.parametrize("text, reason", [
    pytest.param("ValueError: No available memory for the cache blocks.", Reason.KV_CACHE_TOO_SMALL, id="kv"),
    pytest.param("is less than desired GPU memory utilization", Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, id="gmu"),
    pytest.param("CUDA out of memory", Reason.OUT_OF_MEMORY, id="oom"),
    pytest.param("error: argument --max-num-seqs: invalid int value: 'x'", Reason.ENGINE_REFUSED_ARGS, id="bad-arg"),
    pytest.param("Input should be less than or equal to 1 [type=less_than_equal]", Reason.ENGINE_REFUSED_ARGS,
                 id="pydantic-bound"),
    pytest.param("Available memory on node 0 (14.03/16.59 GiB) on kv cache allocation is less than requested memory "
                 "for kv (100.0 GiB). Reduce CPU memory used by other processes.",
                 Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, id="cpu-kv-request-above-free"),
    pytest.param("Available memory on node 0 (0.85/16.59 GiB) on kv cache allocation is less than requested memory "
                 "for kv (-0.01/0.85 GiB). Reduce CPU memory used by other processes.",
                 Reason.KV_CACHE_TOO_SMALL, id="cpu-kv-share-negative-means-gmu-too-low"),
    pytest.param("is less than requested memory for kv (0.0/0.85 GiB)", Reason.KV_CACHE_TOO_SMALL, id="cpu-kv-zero"),
    pytest.param("everything is fine", None, id="nothing-known"),
])
def test_vllm_classify_failure(text, reason):
    assert VLLM.classify_failure(text) == reason


@pytest.mark.parametrize("pod, ready", [
    pytest.param({"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, True, id="ready"),
    pytest.param({"metadata": {"deletionTimestamp": _ts(1)}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                 False, id="being-deleted"),
    pytest.param({"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}, False, id="not-ready"),
    pytest.param({"metadata": {}, "status": {}}, False, id="no-conditions"),
])
def test_pod_ready_requires_ready_condition_and_no_deletion(pod, ready):
    assert pod_is_ready(pod) is ready


GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "vllm-0.32.0-cpu" / "startup-failures"


def _exited(message: str, restarted: bool = False) -> dict:
    terminated = {"exitCode": 1, "reason": "Error", "message": message}
    cs = {"name": "vllm", "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {"terminated": terminated}} \
        if restarted else {"name": "vllm", "state": {"terminated": terminated}}
    return _pod(cs, created=10)


def _kubelet_tail(log: str) -> str:
    """What a termination message holds with FallbackToLogsOnError: the last 80 lines, at most 2 KiB."""
    return "\n".join(log.splitlines()[-80:])[-2048:]


@pytest.mark.parametrize("case, reason", [
    pytest.param("kvcache-space-0", Reason.KV_CACHE_TOO_SMALL, id="no-kv-memory"),
    pytest.param("kv-cache-memory-bytes-1048576", Reason.KV_CACHE_TOO_SMALL, id="kv-below-max-model-len"),
    pytest.param("kvcache-space-100", Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, id="kv-request-above-free"),
    pytest.param("gpu-memory-utilization-0.99", Reason.GPU_MEMORY_UTILIZATION_TOO_HIGH, id="gmu-above-free"),
    pytest.param("max-num-batched-tokens-4", Reason.ENGINE_REFUSED_ARGS, id="args"),
])
def test_real_vllm_startup_failures_classify_from_the_log_when_the_tail_does_not_say(case, reason):
    log = (GOLDEN / f"{case}.log").read_text()
    for restarted in (False, True):
        pod = _exited(_kubelet_tail(log), restarted)
        wanted = log_wanted(pod, "vllm", VLLM)
        tail_alone = classify_pod(pod, "vllm", NOW, 600, VLLM)
        if wanted is None:  # the tail already names the cause
            assert tail_alone is not None and tail_alone.reason is reason
            continue
        assert wanted is restarted  # the previous run's log once the container has restarted
        failure = classify_pod(pod, "vllm", NOW, 600, VLLM, log=log)
        assert failure is not None and failure.reason is reason, (case, failure)
        assert VLLM.classify_failure(failure.message) is reason  # the line quoted says it


def test_a_log_line_that_is_no_error_does_not_classify():
    log = "INFO 12-01 [gpu.py:1] to avoid CUDA out of memory, lower --max-num-seqs\nEngine core initialization failed"
    pod = _exited("Engine core initialization failed")
    assert log_wanted(pod, "vllm", VLLM) is False
    assert classify_pod(pod, "vllm", NOW, 600, VLLM, log=log) is None


def test_no_log_is_wanted_for_a_running_or_recognised_or_oom_killed_container():
    running = _pod({"name": "vllm", "state": {"running": {}}}, created=1000)
    assert log_wanted(running, "vllm", VLLM) is None
    assert log_wanted(_exited("ValueError: No available memory for the cache blocks."), "vllm", VLLM) is None
    killed = _pod({"name": "vllm", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}, created=1000)
    assert log_wanted(killed, "vllm", VLLM) is None
    other = _pod({"name": "sidecar", "state": {"terminated": {"exitCode": 1, "message": "?"}}}, created=1000)
    assert log_wanted(other, "vllm", VLLM) is None


# ---- which pods are evidence ------------------------------------------------------------------------------------


def _owned(kind: str | None, uid: str, controller: bool = True) -> dict:
    refs = [{"apiVersion": "batch/v1", "kind": kind, "name": "n", "uid": uid, "controller": controller}] if kind else []
    return {"metadata": {"name": "p", "ownerReferences": refs, "creationTimestamp": "2026-12-01T08:00:00Z"},
            "status": {"containerStatuses": [{"state": {"terminated": {"message": f"from {kind} {uid}"}}}]}}


@pytest.mark.parametrize("pod, counts", [
    pytest.param(_owned("Job", "job-uid"), True, id="the-jobs-own"),
    pytest.param(_owned(None, ""), False, id="labels-only"),
    pytest.param(_owned("Job", "other-uid"), False, id="another-job"),
    pytest.param(_owned("ReplicaSet", "job-uid"), False, id="same-uid-other-kind"),
    pytest.param(_owned("Job", "job-uid", controller=False), False, id="not-the-controller"),
])
def test_a_load_result_comes_only_from_a_pod_the_job_controls(pod, counts):
    assert (load_message([pod], "job-uid") is not None) is counts
    assert load_message([pod], None) is None  # a Job whose uid is unknown has no evidence


def test_a_trial_pod_counts_only_through_the_trial_deployments_replica_set():
    replica_sets = {("rs", "rs-uid"): "dep-uid", ("evil", "evil-uid"): "someone-else"}
    pods = [_owned("ReplicaSet", "rs-uid"), _owned("ReplicaSet", "evil-uid"), _owned(None, ""),
            _owned("ReplicaSet", "rs-uid", controller=False)]
    pods[0]["metadata"]["ownerReferences"][0]["name"] = "rs"
    pods[1]["metadata"]["ownerReferences"][0]["name"] = "evil"
    found = owned_trial_pods(pods, "dep-uid", lambda name, uid: replica_sets.get((name, uid)))
    assert found == [pods[0]]
    assert owned_trial_pods(pods, None, lambda name, uid: replica_sets.get((name, uid))) == []


# ---- when a load run has ended ----------------------------------------------------------------------------------

RUNNING_JOB = {"startTime": "2026-12-07T16:00:00Z", "active": 1}


def _load_pod(kind: str | None, uid: str, phase: str, exit_code: int | None = 0, controller: bool = True) -> dict:
    pod = _owned(kind, uid, controller)
    pod["status"]["phase"] = phase
    state = pod["status"]["containerStatuses"][0]["state"]
    if exit_code is None:
        pod["status"]["containerStatuses"][0]["state"] = {"running": {"startedAt": "2026-12-07T16:00:01Z"}}
    else:
        state["terminated"].update({"exitCode": exit_code, "finishedAt": "2026-12-07T16:00:09Z"})
    return pod


def test_a_load_run_has_ended_when_its_own_pod_succeeded_before_the_job_is_complete():
    """The Job controller marks the Job Complete after the pod's end, through its own queue: seconds on a loaded control
    plane (docs/benchmarks.md). The pod's end is the run's; the Job's status is not waited for."""
    pod = _load_pod("Job", "job-uid", "Succeeded")
    assert load_run_outcome(RUNNING_JOB, [pod], "job-uid") == (True, False, "2026-12-07T16:00:09Z")
    assert load_message([pod], "job-uid") == "from Job job-uid"


@pytest.mark.parametrize("pod", [
    pytest.param(_load_pod(None, "", "Succeeded"), id="labels-only"),
    pytest.param(_load_pod("Job", "other-uid", "Succeeded"), id="another-job"),
    pytest.param(_load_pod("ReplicaSet", "job-uid", "Succeeded"), id="same-uid-other-kind"),
    pytest.param(_load_pod("Job", "job-uid", "Succeeded", controller=False), id="not-the-controller"),
    pytest.param(_load_pod("Job", "job-uid", "Running", exit_code=None), id="still-running"),
    pytest.param(_load_pod("Job", "job-uid", "Failed", exit_code=1), id="failed: the Job controller decides"),
])
def test_only_the_jobs_own_succeeded_pod_ends_a_run_the_job_has_not(pod):
    assert load_run_outcome(RUNNING_JOB, [pod], "job-uid") == (False, False, None)
    assert load_run_outcome(RUNNING_JOB, [pod], None) == (False, False, None)


def test_the_jobs_own_outcome_comes_first():
    complete = {"startTime": "2026-12-07T16:00:00Z", "completionTime": "2026-12-07T16:00:11Z", "succeeded": 1,
                "conditions": [{"type": "Complete", "status": "True"}]}
    failed = {"startTime": "2026-12-07T16:00:00Z", "failed": 1,
              "conditions": [{"type": "Failed", "status": "True", "lastTransitionTime": "2026-12-07T16:00:12Z"}]}
    succeeded = _load_pod("Job", "job-uid", "Succeeded")
    assert load_run_outcome(complete, [succeeded], "job-uid") == (True, False, "2026-12-07T16:00:11Z")
    assert load_run_outcome(failed, [succeeded], "job-uid") == (True, True, "2026-12-07T16:00:12Z")
    assert load_run_outcome(complete, [], "job-uid") == (True, False, "2026-12-07T16:00:11Z")
