"""Who else manages the target, and what an apply mode therefore resolves to.

Argo CD, Flux and Helm each leave their mark on the objects they apply, in one of three places:

- **labels and annotations** they write themselves: Argo CD's tracking label (label tracking, the
  default label `app.kubernetes.io/instance` or a custom `application.instanceLabelKey`), its
  `argocd.argoproj.io/tracking-id` annotation (annotation tracking, Argo CD 3's default, and
  annotation+label); Flux's owner labels `kustomize.toolkit.fluxcd.io/name|namespace` (kustomize-controller,
  `ssa.ResourceManager.SetOwnerLabels`) and `helm.toolkit.fluxcd.io/name|namespace` (helm-controller's
  post-renderer); Helm's `meta.helm.sh/release-name|namespace` annotations and its
  `app.kubernetes.io/managed-by: Helm` label;
- **managedFields**, the API server's record of who wrote which field: `argocd-controller` (Argo CD's
  `ArgoCDSSAManager`, server-side and client-side syncs), `argocd-application-controller` (its binary
  name, seen on objects it creates without a manager), `kustomize-controller` (operation Apply),
  `helm-controller` (Helm's library names the manager after the binary), `helm` (the Helm CLI sets
  `kube.ManagedFieldsManager = "helm"`).

`app.kubernetes.io/instance` alone is ambiguous (every Helm chart sets it to the release name), so it
counts as Argo CD only beside Argo CD's field manager or with no Helm marker at all; either way it
is a manager, and an unset apply mode never becomes Auto on it.

`resolve_mode` turns spec.apply.mode, the detection and spec.apply.autoUnderManagers into the mode that
runs and the sentence that says why (the Progressing/Recommended condition carries it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Manager(StrEnum):
    """A tool that re-applies a Deployment from its own source (spec.apply.autoUnderManagers)."""

    ARGO_CD = "ArgoCD"
    FLUX = "Flux"
    HELM = "Helm"

    @property
    def words(self) -> str:
        return {"ArgoCD": "Argo CD", "Flux": "Flux", "Helm": "Helm"}[self.value]


ARGO_TRACKING_ANNOTATION = "argocd.argoproj.io/tracking-id"
ARGO_DEFAULT_INSTANCE_LABEL = "app.kubernetes.io/instance"
# The instance labels an install recognises when it is not told otherwise: Argo CD's default and the
# custom label Argo CD's own documentation uses as its example (argocd-cm application.instanceLabelKey).
DEFAULT_INSTANCE_LABELS = (ARGO_DEFAULT_INSTANCE_LABEL, "argocd.argoproj.io/instance")
ARGO_FIELD_MANAGERS = ("argocd-controller", "argocd-application-controller")
FLUX_KUSTOMIZE_LABELS = ("kustomize.toolkit.fluxcd.io/name", "kustomize.toolkit.fluxcd.io/namespace")
FLUX_HELM_LABELS = ("helm.toolkit.fluxcd.io/name", "helm.toolkit.fluxcd.io/namespace")
FLUX_FIELD_MANAGERS = {"kustomize-controller": "kustomize-controller", "helm-controller": "helm-controller"}
HELM_ANNOTATIONS = ("meta.helm.sh/release-name", "meta.helm.sh/release-namespace")
HELM_MANAGED_BY = ("app.kubernetes.io/managed-by", "Helm")
HELM_FIELD_MANAGER = "helm"


@dataclass(frozen=True)
class Finding:
    """One manager and the marks that show it."""

    manager: Manager
    evidence: tuple[str, ...]
    """Each mark, in words (`label app.kubernetes.io/instance=llm`, `managedFields manager argocd-controller`)."""
    owns_args: bool | None = None
    """Whether its field manager owns the engine container's command or args (None: no managedFields of its own)."""

    def describe(self) -> str:
        owns = "" if self.owns_args is None else (
            "; it owns the engine container's command/args" if self.owns_args
            else "; its field manager does not own the engine container's command/args")
        return f"{self.manager.words} ({', '.join(self.evidence)}{owns})"


@dataclass(frozen=True)
class Detection:
    findings: tuple[Finding, ...] = ()

    @property
    def managers(self) -> tuple[Manager, ...]:
        return tuple(f.manager for f in self.findings)

    @property
    def primary(self) -> Finding | None:
        """The manager that re-applies the object: Argo CD over Flux over Helm (Flux drives Helm, Argo CD
        may render a chart)."""
        return self.findings[0] if self.findings else None

    def describe(self) -> str:
        return "; ".join(f.describe() for f in self.findings)

    def __bool__(self) -> bool:
        return bool(self.findings)


def _managed_fields(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    entries = ((obj.get("metadata") or {}).get("managedFields")) or []
    return [e for e in entries if isinstance(e, Mapping)]


def _container_key(name: str) -> str:
    return "k:" + json.dumps({"name": name}, separators=(",", ":"))


def owns_container_args(entry: Mapping[str, Any], container: str | None) -> bool:
    """Whether one managedFields entry owns `command` or `args` of the named container (any container when None)."""
    fields = entry.get("fieldsV1") or {}
    containers = (((fields.get("f:spec") or {}).get("f:template") or {}).get("f:spec") or {}).get("f:containers")
    if not isinstance(containers, Mapping):
        return False
    keys: Iterable[str] = [_container_key(container)] if container else [k for k in containers if k.startswith("k:")]
    for key in keys:
        owned = containers.get(key)
        if isinstance(owned, Mapping) and ("f:args" in owned or "f:command" in owned):
            return True
    return False


def _manager_entries(obj: Mapping[str, Any], names: Iterable[str]) -> list[Mapping[str, Any]]:
    wanted = set(names)
    return [e for e in _managed_fields(obj) if e.get("manager") in wanted]


def _field_evidence(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: list[str] = []
    for e in entries:
        text = f"managedFields manager {e.get('manager')} ({e.get('operation', '?')})"
        if text not in seen:
            seen.append(text)
    return seen


def _owns(entries: Sequence[Mapping[str, Any]], container: str | None) -> bool | None:
    return None if not entries else any(owns_container_args(e, container) for e in entries)


def _tracks_itself(tracking_id: str, obj: Mapping[str, Any]) -> bool:
    """Whether Argo CD's tracking id (`<app>:<group>/<kind>:<namespace>/<name>`) names this very object.

    Argo CD ignores a tracking annotation that names another resource (a copy made by another tool), so
    such an object is not Argo CD's. An id that does not parse counts as Argo CD's (the safe side).
    """
    try:
        _, gk, nn = tracking_id.rsplit(":", 2)
        group, _, kind = gk.rpartition("/")
        namespace, _, name = nn.rpartition("/")
    except ValueError:
        return True
    meta = obj.get("metadata") or {}
    api_group = str(obj.get("apiVersion") or "apps/v1").rpartition("/")[0]
    checks = [(name, meta.get("name")), (kind, obj.get("kind")), (group, api_group),
              (namespace, meta.get("namespace"))]
    return all(want is None or have == want for have, want in checks)


def detect(obj: Mapping[str, Any], container: str | None = None,
           instance_labels: Sequence[str] = DEFAULT_INSTANCE_LABELS) -> Detection:
    """Every manager whose marks `obj` carries, the re-applying one first.

    `container` is the engine container (its args are what would be reverted); `instance_labels` the
    Argo CD tracking labels this install recognises (the default and any custom `instanceLabelKey`).
    """
    meta = obj.get("metadata") or {}
    labels: Mapping[str, Any] = meta.get("labels") or {}
    annotations: Mapping[str, Any] = meta.get("annotations") or {}
    findings: list[Finding] = []

    helm_marks = [f"annotation {k}={annotations[k]}" for k in HELM_ANNOTATIONS if k in annotations]
    if labels.get(HELM_MANAGED_BY[0]) == HELM_MANAGED_BY[1]:
        helm_marks.append(f"label {HELM_MANAGED_BY[0]}={HELM_MANAGED_BY[1]}")
    helm_entries = _manager_entries(obj, [HELM_FIELD_MANAGER])

    flux: list[str] = [f"label {k}={labels[k]}" for k in (*FLUX_KUSTOMIZE_LABELS, *FLUX_HELM_LABELS) if k in labels]
    # Older Flux releases wrote the kustomize owner marks as annotations.
    flux += [f"annotation {k}={annotations[k]}" for k in FLUX_KUSTOMIZE_LABELS if k in annotations]
    flux_entries = _manager_entries(obj, FLUX_FIELD_MANAGERS)

    argo_entries = _manager_entries(obj, ARGO_FIELD_MANAGERS)
    argo: list[str] = []
    tracking = annotations.get(ARGO_TRACKING_ANNOTATION)
    if tracking is not None and _tracks_itself(str(tracking), obj):
        argo.append(f"annotation {ARGO_TRACKING_ANNOTATION}={tracking}")
    others = bool(helm_marks or helm_entries or flux or flux_entries)
    for key in instance_labels:
        if key not in labels:
            continue
        # The default label is Argo CD's only beside Argo CD's own marks, or where no other tool explains it.
        if key != ARGO_DEFAULT_INSTANCE_LABEL or argo_entries or argo or not others:
            argo.append(f"label {key}={labels[key]}")
    if argo or argo_entries:
        findings.append(Finding(Manager.ARGO_CD, tuple(argo + _field_evidence(argo_entries)),
                                _owns(argo_entries, container)))
    if flux or flux_entries:
        findings.append(Finding(Manager.FLUX, tuple(flux + _field_evidence(flux_entries)),
                                _owns(flux_entries, container)))

    if helm_marks or helm_entries:
        findings.append(Finding(Manager.HELM, tuple(helm_marks + _field_evidence(helm_entries)),
                                _owns(helm_entries, container)))
    return Detection(tuple(findings))


def gitops_manager(obj: Mapping[str, Any]) -> str | None:
    """The re-applying manager's name in words ("Argo CD", "Flux", "Helm"), else None."""
    primary = detect(obj).primary
    return primary.manager.words if primary else None


# ---- the mode that runs -----------------------------------------------------------------------

class Mode(StrEnum):
    AUTO = "Auto"
    RECOMMEND = "Recommend"
    PULL_REQUEST = "PullRequest"


UNMANAGED_DEFAULT = Mode.RECOMMEND
"""What an unset spec.apply.mode means on a Deployment no manager was detected on (and no Git is
configured): changing production is an explicit choice (`mode: Auto`). The one place that default lives."""


@dataclass(frozen=True)
class ModeDecision:
    mode: Mode
    why: str
    """One sentence: the spec's word, or what was detected and what it made the mode."""
    downgraded: bool = False
    """An explicit Auto was turned into Recommend or PullRequest because of a manager."""
    detection: Detection = field(default_factory=Detection)
    forced: bool = False
    """Recommend whatever the spec says: a controller owns the target (`core.ownership`) and would revert a patch."""


def resolve_mode(spec_mode: str | None, git_configured: bool, detection: Detection,
                 auto_under: Sequence[str] = ()) -> ModeDecision:
    """The apply mode that runs.

    - Explicit Recommend or PullRequest: as written.
    - Explicit Auto: Auto, unless a detected manager is not listed in spec.apply.autoUnderManagers
      (the author's word that the manager leaves batchtune's fields alone); then PullRequest when
      spec.apply.git is set, else Recommend, and `downgraded`.
    - Unset: PullRequest when spec.apply.git is set; else Recommend when a manager is detected;
      else `UNMANAGED_DEFAULT`.
    """
    fallback = Mode.PULL_REQUEST if git_configured else Mode.RECOMMEND
    seen = detection.describe()
    if spec_mode in (Mode.RECOMMEND, Mode.PULL_REQUEST):
        return ModeDecision(Mode(spec_mode), f"spec.apply.mode is {spec_mode}", detection=detection)
    if spec_mode == Mode.AUTO:
        unlisted = [m for m in detection.managers if m.value not in auto_under]
        if not unlisted:
            why = "spec.apply.mode is Auto"
            if detection:
                why += (f" and spec.apply.autoUnderManagers lists {', '.join(m.value for m in detection.managers)}"
                        f" (detected: {seen})")
            return ModeDecision(Mode.AUTO, why, detection=detection)
        names = ", ".join(m.value for m in unlisted)
        return ModeDecision(fallback, f"spec.apply.mode is Auto but the target is managed by {seen}, which would "
                                      f"revert batchtune's patch; using {fallback.value} instead (list {names} in "
                                      "spec.apply.autoUnderManagers once it ignores batchtune's fields, "
                                      "see docs/gitops.md)", downgraded=True, detection=detection)
    if git_configured:
        why = "spec.apply.mode is unset and spec.apply.git is set"
        return ModeDecision(Mode.PULL_REQUEST, why + (f" (detected: {seen})" if detection else ""), detection=detection)
    if detection:
        return ModeDecision(Mode.RECOMMEND, f"the target is managed by {seen}; spec.apply.mode is unset, so batchtune "
                                            "only recommends (set spec.apply.git for a pull request, or Auto with "
                                            "spec.apply.autoUnderManagers)", detection=detection)
    return ModeDecision(UNMANAGED_DEFAULT, f"spec.apply.mode is unset and no manager (Argo CD, Flux, Helm) was "
                                           f"detected on the target: {UNMANAGED_DEFAULT.value}", detection=detection)
