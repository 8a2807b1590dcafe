"""Who manages the target (Argo CD, Flux, Helm) and what an apply mode resolves to.

The objects are Deployments as each tool leaves them: labels, annotations and managedFields entries
shaped as the API server records them for that tool's writes (field manager names from the tools'
sources: Argo CD's `ArgoCDSSAManager = "argocd-controller"`, Flux's `ssa.Owner{Field: ControllerName}`
and `SetOwnerLabels`, Helm's `kube.ManagedFieldsManager = "helm"` and, in helm-controller, the binary
name). tests/integration/test_gitops_detection.py checks the Helm and kubectl cases on objects the real
tools wrote.
"""

from __future__ import annotations

import pytest

from batchtune.core.gitops import Detection, Manager, Mode, detect, gitops_manager, owns_container_args, resolve_mode

CONTAINER_ARGS = {"f:spec": {"f:template": {"f:spec": {"f:containers": {
    'k:{"name":"vllm"}': {".": {}, "f:args": {}, "f:image": {}, "f:name": {}}}}}}}
CONTAINER_NO_ARGS = {"f:spec": {"f:template": {"f:spec": {"f:containers": {
    'k:{"name":"vllm"}': {".": {}, "f:image": {}, "f:name": {}}}}}}}
KCM_STATUS = {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
              "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
              "fieldsV1": {"f:status": {"f:replicas": {}, "f:readyReplicas": {}}}}


def entry(manager: str, operation: str, fields: dict | None = None, labels: tuple[str, ...] = (),
          annotations: tuple[str, ...] = ()) -> dict:
    meta: dict = {}
    if labels:
        meta["f:labels"] = {".": {}, **{f"f:{k}": {} for k in labels}}
    if annotations:
        meta["f:annotations"] = {".": {}, **{f"f:{k}": {} for k in annotations}}
    fields_v1 = dict(fields or CONTAINER_ARGS)
    if meta:
        fields_v1 = {"f:metadata": meta, **fields_v1}
    return {"manager": manager, "operation": operation, "apiVersion": "apps/v1", "time": "2026-11-30T10:00:00Z",
            "fieldsType": "FieldsV1", "fieldsV1": fields_v1}


def deployment(labels: dict | None = None, annotations: dict | None = None, managed: list | None = None) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "llm", "namespace": "inference", "labels": {"app": "llm", **(labels or {})},
                         "annotations": annotations or {}, "managedFields": [*(managed or []), KCM_STATUS]},
            "spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": ["m"]}]}}}}


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
TRACKING = "argocd.argoproj.io/tracking-id"

CASES = {
    # Argo CD 2.x default: label tracking on app.kubernetes.io/instance, client-side sync (kubectl apply
    # in-process: the last-applied annotation, manager argocd-controller, operation Update).
    "argo-label-default": (deployment(
        labels={"app.kubernetes.io/instance": "llm-app"}, annotations={LAST_APPLIED: "{}"},
        managed=[entry("argocd-controller", "Update", labels=("app", "app.kubernetes.io/instance"),
                       annotations=(LAST_APPLIED,))]),
        Manager.ARGO_CD, ["label app.kubernetes.io/instance=llm-app", "managedFields manager argocd-controller (Update)"]),
    # A custom instanceLabelKey (Argo CD's docs use argocd.argoproj.io/instance), server-side apply sync.
    "argo-label-custom": (deployment(
        labels={"argocd.argoproj.io/instance": "llm-app"},
        managed=[entry("argocd-controller", "Apply", labels=("app", "argocd.argoproj.io/instance"))]),
        Manager.ARGO_CD, ["label argocd.argoproj.io/instance=llm-app", "managedFields manager argocd-controller (Apply)"]),
    # Argo CD 3's default: annotation tracking, <app>:<group>/<kind>:<namespace>/<name>.
    "argo-annotation": (deployment(
        annotations={TRACKING: "llm-app:apps/Deployment:inference/llm"},
        managed=[entry("argocd-controller", "Apply", annotations=(TRACKING,))]),
        Manager.ARGO_CD, ["annotation argocd.argoproj.io/tracking-id=llm-app:apps/Deployment:inference/llm"]),
    # annotation+label: the annotation tracks, the label is informational.
    "argo-annotation-and-label": (deployment(
        labels={"app.kubernetes.io/instance": "llm-app"},
        annotations={TRACKING: "llm-app:apps/Deployment:inference/llm"},
        managed=[entry("argocd-controller", "Apply", labels=("app.kubernetes.io/instance",), annotations=(TRACKING,))]),
        Manager.ARGO_CD, ["annotation argocd.argoproj.io/tracking-id=llm-app:apps/Deployment:inference/llm",
                          "label app.kubernetes.io/instance=llm-app"]),
    # Flux kustomize-controller: owner labels and server-side apply as kustomize-controller.
    "flux-kustomize": (deployment(
        labels={"kustomize.toolkit.fluxcd.io/name": "apps", "kustomize.toolkit.fluxcd.io/namespace": "flux-system"},
        managed=[entry("kustomize-controller", "Apply",
                       labels=("kustomize.toolkit.fluxcd.io/name", "kustomize.toolkit.fluxcd.io/namespace"))]),
        Manager.FLUX, ["label kustomize.toolkit.fluxcd.io/name=apps", "managedFields manager kustomize-controller (Apply)"]),
    # Flux helm-controller: Helm's marks plus the post-renderer's owner labels; Helm's client writes as the binary.
    "flux-helm": (deployment(
        labels={"helm.toolkit.fluxcd.io/name": "vllm", "helm.toolkit.fluxcd.io/namespace": "flux-system",
                "app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/instance": "vllm"},
        annotations={"meta.helm.sh/release-name": "vllm", "meta.helm.sh/release-namespace": "inference"},
        managed=[entry("helm-controller", "Update", labels=("app.kubernetes.io/managed-by",),
                       annotations=("meta.helm.sh/release-name",))]),
        Manager.FLUX, ["label helm.toolkit.fluxcd.io/name=vllm", "managedFields manager helm-controller (Update)"]),
    # The Helm CLI: its annotations, the chart's managed-by and instance labels, manager helm.
    "helm": (deployment(
        labels={"app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/instance": "vllm"},
        annotations={"meta.helm.sh/release-name": "vllm", "meta.helm.sh/release-namespace": "inference"},
        managed=[entry("helm", "Update", labels=("app.kubernetes.io/managed-by",),
                       annotations=("meta.helm.sh/release-name", "meta.helm.sh/release-namespace"))]),
        Manager.HELM, ["annotation meta.helm.sh/release-name=vllm", "managedFields manager helm (Update)"]),
    # Helm seen only in managedFields (the annotations were stripped by hand).
    "helm-managed-fields-only": (deployment(managed=[entry("helm", "Update")]),
                                 Manager.HELM, ["managedFields manager helm (Update)"]),
    # Argo CD seen only in managedFields (a tracking label pruned by a mutating webhook, say).
    "argo-managed-fields-only": (deployment(managed=[entry("argocd-controller", "Apply")]),
                                 Manager.ARGO_CD, ["managedFields manager argocd-controller (Apply)"]),
}


@pytest.mark.parametrize("case", CASES)
def test_detects_the_manager_from_its_marks(case):
    obj, manager, evidence = CASES[case]
    found = detect(obj, "vllm")
    assert found.primary is not None and found.primary.manager is manager, found.describe()
    text = found.describe()
    for mark in evidence:
        assert mark in text, (mark, text)
    assert gitops_manager(obj) == manager.words


def test_helm_chart_instance_label_alone_is_not_argo():
    """Every chart sets app.kubernetes.io/instance; beside Helm's own marks it is Helm's, not Argo CD's."""
    found = detect(CASES["helm"][0], "vllm")
    assert found.managers == (Manager.HELM,)


def test_flux_helm_release_is_flux_first_then_helm():
    found = detect(CASES["flux-helm"][0], "vllm")
    assert found.managers == (Manager.FLUX, Manager.HELM)


def test_instance_label_without_any_other_tool_counts_as_argo_label_tracking():
    found = detect(deployment(labels={"app.kubernetes.io/instance": "llm-app"}), "vllm")
    assert found.managers == (Manager.ARGO_CD,)


def test_a_custom_label_counts_only_when_the_install_names_it():
    obj = deployment(labels={"team.example.com/argo-app": "llm-app"})
    assert not detect(obj, "vllm")
    found = detect(obj, "vllm", instance_labels=("team.example.com/argo-app",))
    assert found.managers == (Manager.ARGO_CD,)
    assert "label team.example.com/argo-app=llm-app" in found.describe()


@pytest.mark.parametrize("managed", [
    pytest.param([entry("kubectl-client-side-apply", "Update")], id="kubectl-apply"),
    pytest.param([entry("kubectl", "Apply")], id="kubectl-apply-server-side"),
    pytest.param([entry("batchtune", "Update")], id="batchtune-itself"),
    pytest.param([], id="none"),
])
def test_plain_deployments_have_no_manager(managed):
    obj = deployment(annotations={LAST_APPLIED: "{}"}, managed=managed)
    assert not detect(obj, "vllm")
    assert gitops_manager(obj) is None


def test_owns_args_reads_the_engine_containers_fields():
    assert owns_container_args(entry("argocd-controller", "Apply"), "vllm")
    assert not owns_container_args(entry("argocd-controller", "Apply"), "sidecar")
    assert not owns_container_args(entry("argocd-controller", "Apply", fields=CONTAINER_NO_ARGS), "vllm")
    assert owns_container_args(entry("argocd-controller", "Apply"), None)
    found = detect(deployment(managed=[entry("argocd-controller", "Apply", fields=CONTAINER_NO_ARGS)]), "vllm")
    assert found.primary is not None and found.primary.owns_args is False
    assert "does not own the engine container's command/args" in found.describe()


def test_missing_metadata_fields():
    assert not detect({"metadata": {}})
    assert not detect({})


# ---- resolve_mode ------------------------------------------------------------------------------

ARGO = detect(CASES["argo-annotation"][0], "vllm")
NONE = Detection()


@pytest.mark.parametrize("spec_mode, git, found, under, mode, downgraded", [
    (None, False, NONE, (), Mode.RECOMMEND, False),  # changing production is an explicit choice
    (None, False, ARGO, (), Mode.RECOMMEND, False),
    (None, True, ARGO, (), Mode.PULL_REQUEST, False),
    (None, True, NONE, (), Mode.PULL_REQUEST, False),
    ("Recommend", True, ARGO, (), Mode.RECOMMEND, False),
    ("PullRequest", True, NONE, (), Mode.PULL_REQUEST, False),
    ("Auto", False, NONE, (), Mode.AUTO, False),
    ("Auto", False, ARGO, (), Mode.RECOMMEND, True),
    ("Auto", True, ARGO, ("Flux",), Mode.PULL_REQUEST, True),
    ("Auto", False, ARGO, ("ArgoCD",), Mode.AUTO, False),
])
def test_resolve_mode(spec_mode, git, found, under, mode, downgraded):
    decision = resolve_mode(spec_mode, git, found, under)
    assert (decision.mode, decision.downgraded) == (mode, downgraded), decision.why
    if found:
        assert "Argo CD (annotation argocd.argoproj.io/tracking-id=" in decision.why or spec_mode != "Auto" \
            or "ArgoCD" in under


def test_a_downgrade_names_the_manager_and_the_way_out():
    decision = resolve_mode("Auto", False, ARGO)
    assert "managed by Argo CD (annotation argocd.argoproj.io/tracking-id=llm-app:apps/Deployment:inference/llm" \
        in decision.why
    assert "spec.apply.autoUnderManagers" in decision.why and "using Recommend" in decision.why


def test_a_tracking_id_naming_another_object_is_a_copy_not_argo():
    """Argo CD ignores a tracking annotation that does not reference the resource it is on (resource_tracking.md)."""
    own = deployment(annotations={TRACKING: "llm-app:apps/Deployment:inference/llm"})
    assert detect(own, "vllm").managers == (Manager.ARGO_CD,)
    copied = deployment(annotations={TRACKING: "llm-app:apps/Deployment:other-namespace/llm"})
    assert not detect(copied, "vllm")
