"""Pure pod status building: container states -> containerStatuses, phase and conditions."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TERMINATION_MESSAGE_BYTES = 4096
FALLBACK_LOG_LINES = 80  # kubelet: last 80 lines ...
FALLBACK_LOG_BYTES = 2048  # ... and at most 2 KiB of them


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(int(ts), tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Terminated:
    exit_code: int
    reason: str
    started_at: float
    finished_at: float
    message: str = ""
    signal: int | None = None
    container_id: str = ""

    def as_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "startedAt": rfc3339(self.started_at),
            "finishedAt": rfc3339(self.finished_at),
        }
        if self.message:
            state["message"] = self.message
        if self.signal:
            state["signal"] = self.signal
        if self.container_id:
            state["containerID"] = self.container_id
        return {"terminated": state}


@dataclass(frozen=True)
class ContainerView:
    """What the status needs to know about one container at one moment."""

    name: str
    image: str
    restart_count: int = 0
    running_since: float | None = None
    terminated: Terminated | None = None
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    last_terminated: Terminated | None = None
    ready: bool = False
    started: bool = False
    container_id: str = ""

    def as_status(self) -> dict[str, Any]:
        if self.running_since is not None:
            state: dict[str, Any] = {"running": {"startedAt": rfc3339(self.running_since)}}
        elif self.terminated is not None:
            state = self.terminated.as_state()
        else:
            waiting: dict[str, Any] = {"reason": self.waiting_reason}
            if self.waiting_message:
                waiting["message"] = self.waiting_message
            state = {"waiting": waiting}
        status: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": f"batchtune-local://{self.image}" if self.container_id else "",
            "ready": self.ready and self.running_since is not None,
            "restartCount": self.restart_count,
            "started": self.started and self.running_since is not None,
            "state": state,
            "lastState": self.last_terminated.as_state() if self.last_terminated else {},
        }
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def termination_reason(returncode: int, killed_by_agent: bool) -> tuple[int, str, int | None]:
    """(exitCode, reason, signal) for a Popen return code (negative = killed by that signal).

    Exit status 137 is the agreed stand-in for the OOM killer; a SIGKILL the agent did not
    send (the kernel's OOM killer) reads the same.
    """
    if returncode < 0:
        signal = -returncode
        code = 128 + signal
        if signal == 9 and not killed_by_agent:
            return code, "OOMKilled", signal
        return code, "Error", signal
    if returncode == 0:
        return 0, "Completed", None
    if returncode == 137:
        return 137, "OOMKilled", None
    return returncode, "Error", None


def termination_message(file_text: bytes | None, log_tail: bytes | None, exit_code: int, policy: str) -> str:
    """terminated.message: the message file, else (FallbackToLogsOnError, on failure) the log tail."""
    if file_text:
        return file_text[:MAX_TERMINATION_MESSAGE_BYTES].decode("utf-8", "replace")
    if policy == "FallbackToLogsOnError" and exit_code != 0 and log_tail:
        lines = log_tail.splitlines(keepends=True)[-FALLBACK_LOG_LINES:]
        tail = b"".join(lines)[-FALLBACK_LOG_BYTES:]
        return tail.decode("utf-8", "replace")
    return ""


def pod_phase(restart_policy: str, containers: Sequence[ContainerView], initialized: bool, init_failed: bool) -> str:  # noqa: C901
    """The kubelet's phase rule (getPhase) over the app containers."""
    if init_failed:
        return "Failed"
    if not initialized:
        return "Pending"
    running = waiting = stopped = succeeded = failed = 0
    for c in containers:
        if c.running_since is not None:
            running += 1
        elif c.terminated is not None:
            stopped += 1
            if c.terminated.exit_code == 0:
                succeeded += 1
            else:
                failed += 1
        elif c.last_terminated is not None:
            # Waiting to restart: counts as stopped with its last result.
            stopped += 1
            if c.last_terminated.exit_code == 0:
                succeeded += 1
            else:
                failed += 1
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always":
            return "Running"
        if restart_policy == "OnFailure":
            return "Succeeded" if stopped == succeeded else "Running"
        return "Failed" if failed else "Succeeded"
    return "Pending"


def _condition(
    ctype: str, ok: bool, now: float, old: Mapping[str, Mapping[str, Any]], reason: str = "", message: str = ""
) -> dict[str, Any]:
    status = "True" if ok else "False"
    previous = old.get(ctype) or {}
    since = previous.get("lastTransitionTime") if previous.get("status") == status else None
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": since or rfc3339(now),
    }
    if not ok and reason:
        cond["reason"] = reason
        if message:
            cond["message"] = message
    return cond


def build_pod_status(
    *,
    pod: Mapping[str, Any],
    containers: Sequence[ContainerView],
    init_containers: Sequence[ContainerView],
    pod_ip: str,
    host_ip: str,
    start_time: float,
    now: float,
    initialized: bool,
    init_failed: bool = False,
    pod_reason: str = "",
    pod_message: str = "",
) -> dict[str, Any]:
    """The full pod status the kubelet would report (sent as a merge patch, so lists are replaced)."""
    spec = pod.get("spec") or {}
    old_status = pod.get("status") or {}
    old = {c.get("type"): c for c in old_status.get("conditions") or [] if isinstance(c, Mapping)}
    phase = "Failed" if pod_reason else pod_phase(
        str(spec.get("restartPolicy") or "Always"), containers, initialized, init_failed
    )
    terminal = phase in ("Succeeded", "Failed")
    unready = [c.name for c in containers if not (c.ready and c.running_since is not None)]
    gates = [g.get("conditionType") for g in spec.get("readinessGates") or []]
    gates_open = all((old.get(g) or {}).get("status") == "True" for g in gates)
    uninitialized = [c.name for c in init_containers if not (c.terminated and c.terminated.exit_code == 0)]

    if terminal:
        ready_reason, ready_message = "PodCompleted", ""
    else:
        ready_reason = "ContainersNotReady"
        ready_message = f"containers with unready status: [{' '.join(unready)}]"
    conditions = [
        _condition("PodReadyToStartContainers", not terminal, now, old),
        _condition(
            "Initialized", initialized, now, old, "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(uninitialized)}]",
        ),
        _condition("Ready", not terminal and not unready and gates_open, now, old,
                   ready_reason if unready or terminal else "ReadinessGatesNotReady",
                   ready_message if unready else ""),
        _condition("ContainersReady", not terminal and not unready, now, old, ready_reason, ready_message),
    ]
    scheduled = old.get("PodScheduled")
    conditions.append(dict(scheduled) if scheduled else _condition("PodScheduled", True, now, old))

    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": rfc3339(start_time),
        "containerStatuses": [c.as_status() for c in containers],
        "reason": pod_reason or None,
        "message": pod_message or None,
    }
    if init_containers:
        status["initContainerStatuses"] = [c.as_status() for c in init_containers]
    return status
