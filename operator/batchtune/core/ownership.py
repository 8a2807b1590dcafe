"""Whether the operator may patch its target, and why not: a controller that owns it, a GitOps tool that syncs it.

A Deployment with a *controller* ownerReference (KServe's InferenceService, a Knative Revision, any operator's
custom resource) is rendered by that controller: a patch to its args is reverted on the owner's next sync, and
verify would then judge someone else's edit. Such a target is never patched, whatever `spec.apply.mode` says;
the tuning ends Recommended with what to change instead (the owner's own spec). A target Argo CD or Flux
manages is only recommended for unless `spec.apply.mode: Auto` says to patch it anyway. When both are found,
the one reason names both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchtune.core.gitops import gitops_manager

AUTO = "Auto"
RECOMMEND = "Recommend"


@dataclass(frozen=True)
class Owner:
    kind: str
    name: str
    api_version: str
    uid: str = ""

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0] if "/" in self.api_version else ""

    def label(self) -> str:
        return f"{self.kind} {self.name} ({self.api_version})"


# Where the engine's args live for owners whose shape is known; any other owner gets the generic advice.
_INSTEAD: dict[tuple[str, str], str] = {
    ("serving.kserve.io", "InferenceService"): "set the args in the InferenceService's "
                                               "spec.predictor.model.args (or its ServingRuntime's container args)",
    ("serving.knative.dev", "Revision"): "set the args in the Knative Service's spec.template (a Revision is "
                                         "immutable; the Service rolls out a new one)",
    ("apps", "ReplicaSet"): "tune the Deployment that owns the ReplicaSet instead",
}


def controller_owner(obj: Mapping[str, Any]) -> Owner | None:
    """The object's controller (the ownerReference with `controller: true`), or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") is True:
            return Owner(str(ref.get("kind") or "?"), str(ref.get("name") or "?"), str(ref.get("apiVersion") or ""),
                         str(ref.get("uid") or ""))
    return None


def instead(owner: Owner) -> str:
    """What to change instead of the Deployment its owner renders."""
    known = _INSTEAD.get((owner.group, owner.kind))
    if known:
        return known
    return (f"set the args where the {owner.kind} takes them (its spec), from status.recommendation.args; "
            f"the {owner.kind}'s controller renders this Deployment")


@dataclass(frozen=True)
class ApplyMode:
    mode: str
    """Auto or Recommend."""
    why: str
    """Why this mode: the spec's field, or what was found on the target (one sentence naming all of it)."""
    owner: Owner | None = None
    gitops: str | None = None

    @property
    def forced(self) -> bool:
        """Recommend although the spec says Auto: a controller owns the target."""
        return self.owner is not None


def apply_mode(spec_mode: str | None, deployment: Mapping[str, Any]) -> ApplyMode:
    """Auto or Recommend for this target, and the reason."""
    meta = deployment.get("metadata") or {}
    where = f"Deployment {meta.get('namespace', '?')}/{meta.get('name', '?')}"
    owner = controller_owner(deployment)
    manager = gitops_manager(deployment)
    if owner is not None:
        why = f"{where} is controlled by {owner.label()}, which would revert a patch"
        if manager:
            why += f" (and {manager} manages it)"
        why += f"; {instead(owner)}"
        if spec_mode == AUTO:
            why += "; spec.apply.mode Auto cannot override this"
        return ApplyMode(RECOMMEND, why, owner, manager)
    if spec_mode:
        return ApplyMode(spec_mode, f"spec.apply.mode is {spec_mode}", None, manager)
    if manager:
        return ApplyMode(RECOMMEND, f"the target is managed by {manager}; set spec.apply.mode: Auto to patch it anyway",
                         None, manager)
    return ApplyMode(AUTO, "spec.apply.mode is unset and nothing else manages the target")
