"""Why a trial pod did not become ready: pure classification of pod status into trial verdicts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Mapping


class FailureReason(StrEnum):
    OOM_KILLED = "OOMKilled"
    KV_CACHE_DOES_NOT_FIT = "KvCacheTooSmall"
    INSUFFICIENT_GPU_MEMORY = "GpuMemoryUtilizationTooHigh"
    CRASH_LOOP = "CrashLoopBackOff"
    UNSCHEDULABLE = "Unschedulable"
    IMAGE_PULL = "ImagePullBackOff"
    READINESS_TIMEOUT = "ReadinessTimeout"


@dataclass(frozen=True)
class TrialFailure:
    reason: FailureReason
    message: str


# vLLM's own startup messages (see shared/reference/vllm-gpu-facts.md §2.3), matched case-insensitively.
_KV_MESSAGES = (
    "no available memory for the cache blocks",
    "larger than the maximum number of tokens that can be stored in kv cache",
    "to serve at least one request with the models's max seq len",
    "to serve at least one request with the model's max seq len",
    "kv cache",
)
_MEMORY_MESSAGES = (
    "free memory on device",
    "is less than desired gpu memory utilization",
    "cuda out of memory",
    "outofmemoryerror",
)
_IMAGE_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}

# An unschedulable trial may only be waiting for another trial's GPU; give the scheduler this long.
UNSCHEDULABLE_GRACE_SECONDS = 60


def _memory_reason(message: str) -> FailureReason | None:
    text = message.lower()
    if any(m in text for m in _KV_MESSAGES):
        return FailureReason.KV_CACHE_DOES_NOT_FIT
    if any(m in text for m in _MEMORY_MESSAGES):
        return FailureReason.INSUFFICIENT_GPU_MEMORY
    return None


def _first_line(message: str, limit: int = 400) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    # vLLM prints a traceback; the last line carries the error itself.
    line = lines[-1] if lines else ""
    return line[:limit]


def _age_seconds(timestamp: str | None, now: datetime) -> float:
    if not timestamp:
        return 0.0
    started = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return (now - started).total_seconds()


def classify_pod(pod: Mapping[str, Any], container: str | None, now: datetime,
                 readiness_timeout_s: float, created_at: str | None = None) -> TrialFailure | None:
    """Returns why the pod can never become a ready vLLM server, or None while it still may."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"):
            message = cond.get("message") or "no node fits the pod"
            # GPUs taken by other work is a wait (until the readiness timeout), not a verdict on the setting.
            waiting_for_gpus = "insufficient nvidia.com/gpu" in message.lower()
            if not waiting_for_gpus and _age_seconds(cond.get("lastTransitionTime") or created_at,
                                                     now) >= UNSCHEDULABLE_GRACE_SECONDS:
                return TrialFailure(FailureReason.UNSCHEDULABLE, message)

    for cs in status.get("containerStatuses") or []:
        if container and cs.get("name") != container:
            continue
        waiting = (cs.get("state") or {}).get("waiting") or {}
        terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
        if waiting.get("reason") in _IMAGE_REASONS:
            return TrialFailure(FailureReason.IMAGE_PULL, waiting.get("message") or waiting["reason"])
        if terminated:
            message = terminated.get("message") or ""
            if terminated.get("reason") == "OOMKilled" or terminated.get("exitCode") == 137:
                return TrialFailure(FailureReason.OOM_KILLED,
                                    _first_line(message) or "the vLLM process was killed for using too much memory")
            memory = _memory_reason(message)
            if memory is not None:
                return TrialFailure(memory, _first_line(message))
        if waiting.get("reason") == "CrashLoopBackOff":
            detail = _first_line(terminated.get("message") or "") or waiting.get("message") or "container keeps exiting"
            return TrialFailure(FailureReason.CRASH_LOOP, detail)

    if _age_seconds(created_at or (pod.get("metadata") or {}).get("creationTimestamp"), now) > readiness_timeout_s:
        return TrialFailure(FailureReason.READINESS_TIMEOUT,
                            f"not ready after {int(readiness_timeout_s)}s (spec.trial.readinessTimeoutSeconds)")
    return None


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
