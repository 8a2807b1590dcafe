"""Who else manages the target: Argo CD and Flux markers."""

from __future__ import annotations

import pytest

from batchtune.core.gitops import gitops_manager


@pytest.mark.parametrize("meta, expected", [
    pytest.param({"labels": {"argocd.argoproj.io/instance": "prod"}}, "Argo CD", id="argo-label"),
    pytest.param({"annotations": {"argocd.argoproj.io/tracking-id": "a:apps/Deployment:ns/x"}}, "Argo CD",
                 id="argo-tracking-id"),
    pytest.param({"labels": {"kustomize.toolkit.fluxcd.io/name": "apps"}}, "Flux", id="flux-kustomize"),
    pytest.param({"labels": {"helm.toolkit.fluxcd.io/name": "vllm"}}, "Flux", id="flux-helm"),
    pytest.param({"annotations": {"kustomize.toolkit.fluxcd.io/namespace": "flux-system"}}, "Flux", id="flux-annotation"),
    pytest.param({"labels": {"app": "vllm"}}, None, id="plain"),
    pytest.param({}, None, id="no-metadata-fields"),
])
def test_gitops_manager(meta, expected):
    assert gitops_manager({"metadata": meta}) == expected
