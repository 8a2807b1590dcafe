"""Which pods are evidence, and why a trial pod did not become ready: pure decisions on pod status.

Labels are no evidence: anyone who may create pods in the namespace can copy them. A load pod counts only when its
controller is the load Job (by uid), a trial pod only when its controller is a ReplicaSet whose controller is the
trial Deployment (by uid).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from batchtune.core.ownership import controller_owner
from batchtune.core.vocabulary import Reason

if TYPE_CHECKING:
    from batchtune.engines import Engine


@dataclass(frozen=True)
class TrialFailure:
    reason: Reason
    message: str


_IMAGE_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}

# An unschedulable trial may only be waiting for another trial's GPU; give the scheduler this long.
UNSCHEDULABLE_GRACE_SECONDS = 60


def _first_line(message: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    # vLLM prints a traceback; the last line carries the error itself.
    line = lines[-1] if lines else ""
    return line[:limit]


def _telling_line(message: str, reason: Reason, engine: Engine, limit: int = 400) -> str:
    """The line that says `reason` (a traceback's last line is often only "initialization failed")."""
    for line in reversed(message.strip().splitlines()):
        if line.strip() and engine.classify_failure(line) == reason:
            return line.strip()[:limit]
    return _first_line(message, limit)


def _error_lines(log: str) -> str:
    """The log's error lines only: an INFO or WARNING line that mentions memory is no verdict on the setting."""
    return "\n".join(line for line in log.splitlines() if "error" in line.lower() or "exception" in line.lower())


def _age_seconds(timestamp: str | None, now: datetime) -> float:
    if not timestamp:
        return 0.0
    started = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return (now - started).total_seconds()


def classify_pod(pod: Mapping[str, Any], container: str | None, now: datetime, readiness_timeout_s: float,
                 engine: Engine, created_at: str | None = None, log: str | None = None) -> TrialFailure | None:
    """Returns why the pod can never become a ready vLLM server, or None while it still may.

    `log` is the end of the engine container's log, read when `log_wanted` says so: the engine's own
    cause of a startup failure is often above the termination message's tail.
    """
    status = pod.get("status") or {}
    unschedulable = _unschedulable(status, now, created_at)
    if unschedulable is not None:
        return unschedulable
    for cs in status.get("containerStatuses") or []:
        if container and cs.get("name") != container:
            continue
        failure = _container_failure(cs, engine, log)
        if failure is not None:
            return failure
    if _age_seconds(created_at or (pod.get("metadata") or {}).get("creationTimestamp"), now) > readiness_timeout_s:
        return TrialFailure(Reason.READINESS_TIMEOUT,
                            f"not ready after {int(readiness_timeout_s)}s (spec.trial.readinessTimeoutSeconds)")
    return None


def _unschedulable(status: Mapping[str, Any], now: datetime, created_at: str | None) -> TrialFailure | None:
    """Unschedulable past the grace period, for a reason other than GPUs other work holds."""
    for cond in status.get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"):
            message = cond.get("message") or "no node fits the pod"
            # GPUs taken by other work is a wait (until the readiness timeout), not a verdict on the setting.
            waiting_for_gpus = "insufficient nvidia.com/gpu" in message.lower()
            if not waiting_for_gpus and _age_seconds(cond.get("lastTransitionTime") or created_at,
                                                     now) >= UNSCHEDULABLE_GRACE_SECONDS:
                return TrialFailure(Reason.UNSCHEDULABLE, message)
    return None


def _container_failure(cs: Mapping[str, Any], engine: Engine, log: str | None) -> TrialFailure | None:
    """What the engine container's state says it failed of: its image, memory, the engine's own words, a crash loop."""
    waiting = (cs.get("state") or {}).get("waiting") or {}
    terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    if waiting.get("reason") in _IMAGE_REASONS:
        return TrialFailure(Reason.IMAGE_PULL_BACK_OFF, waiting.get("message") or waiting["reason"])
    if terminated:
        failure = _termination(terminated, engine, log)
        if failure is not None:
            return failure
    if waiting.get("reason") == "CrashLoopBackOff":
        detail = _first_line(terminated.get("message") or "") or waiting.get("message") or "container keeps exiting"
        return TrialFailure(Reason.CRASH_LOOP_BACK_OFF, detail)
    return None


def _termination(terminated: Mapping[str, Any], engine: Engine, log: str | None) -> TrialFailure | None:
    """Why the engine exited: killed for memory, else the cause its termination message or log names."""
    message = terminated.get("message") or ""
    if terminated.get("reason") == "OOMKilled" or terminated.get("exitCode") == 137:
        return TrialFailure(Reason.OOM_KILLED,
                            _first_line(message) or f"the {engine.display} process was killed for using too much memory")
    known = engine.classify_failure(message)
    if known is not None:
        return TrialFailure(known, _telling_line(message, known, engine))
    errors = _error_lines(log) if log else ""
    known = engine.classify_failure(errors) if errors else None
    if known is not None:
        return TrialFailure(known, _telling_line(errors, known, engine))
    return None


def log_wanted(pod: Mapping[str, Any], container: str | None, engine: Engine) -> bool | None:
    """None: no log needed; else whether to read the previous run's log (True) or the current one's (False).

    Wanted when the engine container has exited with a message the engine's failure signatures do not
    recognise: the cause is then usually further up its log.
    """
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if container and cs.get("name") != container:
            continue
        state = cs.get("state") or {}
        terminated = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if not terminated or terminated.get("reason") == "OOMKilled" or terminated.get("exitCode") == 137:
            continue
        if engine.classify_failure(terminated.get("message") or "") is None:
            return "terminated" not in state  # restarted since: the failure is the previous run's
    return None


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def controlled_by(obj: Mapping[str, Any], kind: str, uid: str | None) -> bool:
    """Whether the object's controller ownerReference is the `kind` object of that uid."""
    owner = controller_owner(obj)
    return bool(uid) and owner is not None and owner.kind == kind and owner.uid == uid


def load_message(pods: Iterable[Mapping[str, Any]], job_uid: str | None) -> str | None:
    """The load generator's termination message from the Job's own pods (controlled by `job_uid`); pods that only
    carry the Job's labels are ignored."""
    message = None
    for pod in sorted((p for p in pods if controlled_by(p, "Job", job_uid)),
                      key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or ""):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or {}
            if terminated.get("message"):
                message = str(terminated["message"])
    return message


def job_outcome(status: Mapping[str, Any]) -> tuple[bool, bool, str | None]:
    """(finished, failed, when it ended) of a Job, from its status as the Job controller writes it."""
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    failed = "Failed" in conditions
    finished = failed or "Complete" in conditions or bool(status.get("succeeded"))
    ended = status.get("completionTime") or (conditions.get("Failed") or conditions.get("Complete") or {}).get(
        "lastTransitionTime")
    return finished, failed, ended


def load_pod_succeeded(pod: Mapping[str, Any]) -> str | None:
    """When a load pod's every container ended with success (phase Succeeded): the last one's `finishedAt`, or ""
    when none says; None while it has not succeeded. Whose pod it is, is `controlled_by`'s to say."""
    status = pod.get("status") or {}
    if status.get("phase") != "Succeeded":
        return None
    ends = [str(t["finishedAt"]) for cs in status.get("containerStatuses") or []
            if (t := (cs.get("state") or {}).get("terminated") or {}).get("finishedAt")]
    return max(ends, default="")


def load_run_outcome(job_status: Mapping[str, Any], pods: Iterable[Mapping[str, Any]],
                     job_uid: str | None) -> tuple[bool, bool, str | None]:
    """(finished, failed, when it ended) of a load run: the Job's own outcome (`job_outcome`), or, before the Job
    controller has marked it Complete, its own pod (controlled by `job_uid`) having succeeded: the load generator has
    exited 0 and its termination message holds its summary. The Job controller's Complete condition comes after the
    pod's end, through its own queue and the Job watch (seconds on a loaded control plane: docs/benchmarks.md); a pod
    that only carries the Job's labels is no evidence. A failed pod still waits for the Job controller's verdict
    (its `backoffLimit` and `podFailurePolicy` decide whether the run failed)."""
    finished, failed, ended = job_outcome(job_status)
    if finished:
        return finished, failed, ended
    ends = [end for pod in pods if controlled_by(pod, "Job", job_uid) and (end := load_pod_succeeded(pod)) is not None]
    if not ends:
        return False, False, None
    return True, False, max(ends) or None


def owned_trial_pods(pods: Iterable[Mapping[str, Any]], deployment_uid: str | None,
                     replica_set_controller: Callable[[str, str], str | None]) -> list[Mapping[str, Any]]:
    """The pods of the trial Deployment `deployment_uid`: controlled by a ReplicaSet that it controls.

    `replica_set_controller(name, uid)`: the uid of the controller of ReplicaSet `name` when that ReplicaSet has this
    uid, else None."""
    out = []
    for pod in pods:
        owner = controller_owner(pod)
        if deployment_uid and owner is not None and owner.kind == "ReplicaSet" and owner.uid \
                and replica_set_controller(owner.name, owner.uid) == deployment_uid:
            out.append(pod)
    return out
