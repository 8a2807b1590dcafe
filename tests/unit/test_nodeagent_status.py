"""Pod status building from container states."""

from __future__ import annotations

import pytest

from batchtune_local.nodeagent.status import (
    ContainerView,
    Terminated,
    build_pod_status,
    pod_phase,
    termination_message,
    termination_reason,
)

T0 = 1_700_000_000.0
OK = Terminated(0, "Completed", T0, T0 + 5)
BAD = Terminated(1, "Error", T0, T0 + 5)


def running(name="c", ready=True):
    return ContainerView(name, "img", running_since=T0, ready=ready, started=True)


def waiting(name="c", reason="ContainerCreating", last=None):
    return ContainerView(name, "img", waiting_reason=reason, last_terminated=last)


def done(term, name="c"):
    return ContainerView(name, "img", terminated=term)


@pytest.mark.parametrize(
    "policy, containers, expected",
    [
        pytest.param("Always", [waiting()], "Pending", id="never-started"),
        pytest.param("Always", [running()], "Running", id="running"),
        pytest.param("Always", [waiting(reason="CrashLoopBackOff", last=BAD)], "Running", id="crashloop-is-running"),
        pytest.param("Always", [running(), waiting("d", "ErrImagePull")], "Pending", id="one-pulling"),
        pytest.param("Never", [done(OK)], "Succeeded", id="job-ok"),
        pytest.param("Never", [done(BAD)], "Failed", id="job-failed"),
        pytest.param("Never", [done(OK), running("d")], "Running", id="job-one-left"),
        pytest.param("OnFailure", [done(OK)], "Succeeded", id="onfailure-ok"),
        pytest.param("OnFailure", [waiting(reason="CrashLoopBackOff", last=BAD)], "Running", id="onfailure-retrying"),
    ],
)
def test_pod_phase(policy, containers, expected):
    assert pod_phase(policy, containers, initialized=True, init_failed=False) == expected


def test_phase_waits_for_init_and_fails_with_it():
    assert pod_phase("Always", [running()], initialized=False, init_failed=False) == "Pending"
    assert pod_phase("Never", [waiting()], initialized=False, init_failed=True) == "Failed"


@pytest.mark.parametrize(
    "returncode, killed, expected",
    [
        pytest.param(0, False, (0, "Completed", None), id="zero"),
        pytest.param(1, False, (1, "Error", None), id="one"),
        pytest.param(137, False, (137, "OOMKilled", None), id="exit-137"),
        pytest.param(-9, False, (137, "OOMKilled", 9), id="sigkill-not-ours"),
        pytest.param(-9, True, (137, "Error", 9), id="sigkill-ours"),
        pytest.param(-15, True, (143, "Error", 15), id="sigterm"),
    ],
)
def test_termination_reason(returncode, killed, expected):
    assert termination_reason(returncode, killed) == expected


@pytest.mark.parametrize(
    "file_text, log_tail, code, policy, expected",
    [
        pytest.param(b"done: 42", b"log", 0, "File", "done: 42", id="file"),
        pytest.param(b"x" * 5000, None, 0, "File", "x" * 4096, id="file-capped-4k"),
        pytest.param(None, b"a\nb\n", 1, "File", "", id="no-file-no-fallback"),
        pytest.param(None, b"a\nb\n", 1, "FallbackToLogsOnError", "a\nb\n", id="fallback-on-error"),
        pytest.param(None, b"a\nb\n", 0, "FallbackToLogsOnError", "", id="no-fallback-on-success"),
        pytest.param(None, b"".join(b"%d\n" % i for i in range(200)), 1, "FallbackToLogsOnError",
                     "".join(f"{i}\n" for i in range(120, 200)), id="last-80-lines"),
    ],
)
def test_termination_message(file_text, log_tail, code, policy, expected):
    assert termination_message(file_text, log_tail, code, policy) == expected


def build(containers, pod=None, **kw):
    pod = pod or {"spec": {"restartPolicy": "Always"}, "status": {}}
    return build_pod_status(pod=pod, containers=containers, init_containers=[], pod_ip="127.1.0.5",
                            host_ip="127.0.0.1", start_time=T0, now=T0 + 10, initialized=True, **kw)


def conditions(status):
    return {c["type"]: c for c in status["conditions"]}


def test_running_ready_pod():
    status = build([running()])
    assert status["phase"] == "Running"
    assert status["podIP"] == "127.1.0.5" and status["podIPs"] == [{"ip": "127.1.0.5"}]
    assert status["hostIP"] == "127.0.0.1"
    cs = status["containerStatuses"][0]
    assert cs["ready"] and cs["started"] and "running" in cs["state"]
    assert {t: c["status"] for t, c in conditions(status).items()} == {
        "PodReadyToStartContainers": "True", "Initialized": "True", "Ready": "True", "ContainersReady": "True",
        "PodScheduled": "True"}


def test_unready_pod_names_container_and_keeps_transition_times():
    first = build([running("a", ready=False)])
    ready = conditions(first)["Ready"]
    assert ready["status"] == "False" and ready["message"] == "containers with unready status: [a]"
    again = build([running("a", ready=False)], pod={"spec": {}, "status": {"conditions": first["conditions"]}})
    assert again == first  # nothing changes -> nothing to patch


def test_crashloop_status_shape():
    status = build([waiting(reason="CrashLoopBackOff", last=BAD)])
    cs = status["containerStatuses"][0]
    assert cs["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}
    assert cs["lastState"]["terminated"]["exitCode"] == 1


def test_terminal_pod_is_not_ready_with_pod_completed():
    status = build([done(OK)], pod={"spec": {"restartPolicy": "Never"}, "status": {}})
    assert status["phase"] == "Succeeded"
    assert conditions(status)["Ready"]["reason"] == "PodCompleted"


def test_admission_error_fails_the_pod():
    status = build([waiting()], pod_reason="UnexpectedAdmissionError", pod_message="no GPUs")
    assert (status["phase"], status["reason"], status["message"]) == ("Failed", "UnexpectedAdmissionError", "no GPUs")


def test_readiness_gate_holds_ready():
    pod = {"spec": {"readinessGates": [{"conditionType": "example.com/gate"}]}, "status": {}}
    assert conditions(build([running()], pod=pod))["Ready"]["status"] == "False"
    pod["status"]["conditions"] = [{"type": "example.com/gate", "status": "True"}]
    assert conditions(build([running()], pod=pod))["Ready"]["status"] == "True"
