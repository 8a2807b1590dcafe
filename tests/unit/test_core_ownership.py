"""core.ownership: who owns the target, and the apply mode that follows, with its one reason."""

from __future__ import annotations

import pytest

from batchtune.core.ownership import apply_mode, controller_owner, instead


def deployment(owners=(), labels=None) -> dict:
    return {"metadata": {"name": "llm", "namespace": "ns", "labels": dict(labels or {}),
                         "ownerReferences": list(owners)}}


def ref(kind: str, api_version: str, name: str = "x", controller: bool | None = True) -> dict:
    out = {"kind": kind, "apiVersion": api_version, "name": name, "uid": "u"}
    if controller is not None:
        out["controller"] = controller
    return out


ARGO = {"argocd.argoproj.io/instance": "prod"}


@pytest.mark.parametrize("owners, expected", [
    pytest.param([], None, id="none"),
    pytest.param([ref("ConfigMap", "v1", controller=None)], None, id="owner-not-controller"),
    pytest.param([ref("Thing", "example.com/v1", controller=False)], None, id="controller-false"),
    pytest.param([ref("Thing", "example.com/v1", controller=False), ref("InferenceService", "serving.kserve.io/v1beta1")],
                 "InferenceService", id="the-controller-among-several"),
])
def test_controller_owner(owners, expected):
    owner = controller_owner(deployment(owners))
    assert (owner.kind if owner else None) == expected


@pytest.mark.parametrize("kind, api_version, words", [
    pytest.param("InferenceService", "serving.kserve.io/v1beta1", "spec.predictor.model.args", id="kserve"),
    pytest.param("Revision", "serving.knative.dev/v1", "Knative Service's spec.template", id="knative"),
    pytest.param("ReplicaSet", "apps/v1", "Deployment that owns", id="replicaset"),
    pytest.param("LlamaServer", "example.com/v1", "where the LlamaServer takes them", id="any-operator"),
])
def test_what_to_change_instead_names_where_the_args_go(kind, api_version, words):
    owner = controller_owner(deployment([ref(kind, api_version)]))
    assert owner is not None and words in instead(owner)


@pytest.mark.parametrize("spec_mode, owners, labels, mode, words", [
    pytest.param(None, [], {}, "Auto", "nothing else manages", id="plain-auto"),
    pytest.param("Recommend", [], {}, "Recommend", "spec.apply.mode is Recommend", id="spec-recommend"),
    pytest.param(None, [], ARGO, "Recommend", "managed by Argo CD; set spec.apply.mode: Auto", id="gitops"),
    pytest.param("Auto", [], ARGO, "Auto", "spec.apply.mode is Auto", id="gitops-explicit-auto"),
    pytest.param("Auto", [ref("InferenceService", "serving.kserve.io/v1beta1", "llama")], {}, "Recommend",
                 "Deployment ns/llm is controlled by InferenceService llama (serving.kserve.io/v1beta1)",
                 id="owned-explicit-auto"),
    pytest.param(None, [ref("LlamaServer", "example.com/v1", "s")], ARGO, "Recommend",
                 "which would revert a patch (and Argo CD manages it)", id="owned-and-gitops"),
])
def test_apply_mode(spec_mode, owners, labels, mode, words):
    decided = apply_mode(spec_mode, deployment(owners, labels))
    assert decided.mode == mode and words in decided.why
    assert decided.forced is bool(owners)
