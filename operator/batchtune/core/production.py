"""What batchtune did to production, recorded on the Deployment itself, and the patches that do it.

Every change to production carries, in the same request, the `batchtune.io/applied` annotation: which
BatchTuning (name, uid, generation) applied what, over what, when, and whether it was verified. A
crash between the patch and the status write resumes from it; a rollback restores the previous args
only when production still runs exactly what batchtune applied (anyone else's later edit wins, and is
reported); a rollback target is taken from the annotation and must agree with status.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from batchtune.core.recommend import ContainerArgs, command_line_problem

ANNOTATION_APPLIED = "batchtune.io/applied"
ANNOTATION_APPLIED_AT = "batchtune.io/applied-at"
"""When batchtune last changed this Deployment (any BatchTuning): the cooldown reads it."""


class MarkState(StrEnum):
    APPLIED = "Applied"
    """Patched, not yet verified: the only state in which a rollback may happen."""
    VERIFIED = "Verified"
    KEPT = "Kept"
    """Verify was inconclusive and the policy kept the setting."""
    ROLLED_BACK = "RolledBack"


@dataclass(frozen=True)
class AppliedMark:
    tuning: str
    uid: str
    generation: int
    container: str
    previous: ContainerArgs
    applied: ContainerArgs
    applied_at: datetime
    state: MarkState = MarkState.APPLIED
    round: int = 1
    """The round of continuous tuning that applied it (spec.retune); absent in the annotation: 1."""

    def by(self, uid: str, generation: int | None = None, round_: int | None = None) -> bool:
        return self.uid == uid and (generation is None or self.generation == generation) and \
            (round_ is None or self.round == round_)

    def with_state(self, state: MarkState) -> AppliedMark:
        return replace(self, state=state)

    def to_annotation(self) -> str:
        return json.dumps({
            "tuning": self.tuning, "uid": self.uid, "generation": self.generation, "container": self.container,
            "previous": self.previous.to_wire(), "applied": self.applied.to_wire(),
            "appliedAt": self.applied_at.strftime("%Y-%m-%dT%H:%M:%SZ"), "state": self.state.value,
            **({"round": self.round} if self.round != 1 else {}),
        }, sort_keys=True, separators=(",", ":"))

    @classmethod
    def read(cls, deployment: Mapping[str, Any]) -> AppliedMark | None:
        """The mark on a Deployment, or None when absent or unreadable (then nothing is trusted from it)."""
        text = ((deployment.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(str(data["tuning"]), str(data["uid"]), int(data["generation"]), str(data["container"]),
                       _args(data["previous"]), _args(data["applied"]),
                       datetime.fromisoformat(str(data["appliedAt"])),
                       MarkState(data.get("state", MarkState.APPLIED)), int(data.get("round", 1)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def _args(data: Any) -> ContainerArgs:
    """Container args from the annotation; TypeError (read() then trusts nothing) unless an object of string lists
    within the command-line bounds status keeps."""
    if not isinstance(data, dict):
        raise TypeError
    for key in ("command", "args"):
        value = data.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(a, str) for a in value)):
            raise TypeError
    args = ContainerArgs.of(data)
    if command_line_problem(args, "the mark"):  # batchtune never writes one status could not keep: not its mark
        raise TypeError
    return args


def container_of(deployment: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    containers = (((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    return next((dict(c) for c in containers if c.get("name") == name), None)


def fingerprint(container: Mapping[str, Any]) -> str:
    """What a trial clones from production's engine container, hashed: a change means stale measurements."""
    relevant = {k: container.get(k) for k in ("image", "command", "args", "env", "envFrom", "resources",
                                              "volumeMounts")}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def args_patch(container: str, args: ContainerArgs, annotations: Mapping[str, str | None],
               resource_version: str) -> dict[str, Any]:
    """A strategic-merge patch setting one container's command and args (None removes the field) and our
    annotations, valid only at `resource_version` (the API server answers 409 otherwise)."""
    return {
        "metadata": {"resourceVersion": resource_version, "annotations": dict(annotations)},
        "spec": {"template": {"spec": {"containers": [
            {"name": container, "command": None if args.command is None else list(args.command),
             "args": None if args.args is None else list(args.args)}]}}},
    }


def rollout_complete(deployment: Mapping[str, Any]) -> bool:
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    replicas = spec.get("replicas", 1)
    return bool(status.get("observedGeneration", 0) >= (deployment.get("metadata") or {}).get("generation", 0)
            and status.get("updatedReplicas", 0) == replicas
            and status.get("availableReplicas", 0) >= replicas
            and status.get("replicas", 0) == replicas)


class Restore(StrEnum):
    RESTORE = "Restore"
    CHANGED_BY_OTHERS = "ChangedByOthers"
    NOTHING = "Nothing"
    """No unverified change of this BatchTuning is on production."""
    DISAGREES = "Disagrees"
    """The annotation and status name different previous args: neither is trusted to restore."""


def rollback_decision(deployment: Mapping[str, Any], uid: str, status_previous: ContainerArgs | None) -> tuple[Restore, AppliedMark | None]:
    """Whether a rollback may restore production, from what production carries now."""
    mark = AppliedMark.read(deployment)
    if mark is None or not mark.by(uid) or mark.state is not MarkState.APPLIED:
        return Restore.NOTHING, mark
    current = container_of(deployment, mark.container)
    if current is None or ContainerArgs.of(current) != mark.applied:
        return Restore.CHANGED_BY_OTHERS, mark
    if status_previous is not None and status_previous != mark.previous:
        return Restore.DISAGREES, mark
    return Restore.RESTORE, mark
