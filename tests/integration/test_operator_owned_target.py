"""A target Deployment that another controller owns (ownerReference `controller: true` to a custom resource, as a
KServe InferenceService owns its predictor) is tuned but never patched, even with `spec.apply.mode: Auto`."""

from __future__ import annotations

import json

import pytest
from operator_env import (
    LENIENT_SLO,
    batchtuning,
    condition,
    grant_operator_rbac,
    production,
    running_operator,
    wait_phase,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUP, KIND, PLURAL = "owners.batchtune.test", "LlamaServer", "llamaservers"


@pytest.fixture(scope="module")
def owner_crd(kube, kubectl, batchtuning_crd, wait_for):
    """A small custom resource standing in for KServe's InferenceService (left in place: other lanes may use it)."""
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {"group": GROUP, "scope": "Namespaced",
                 "names": {"kind": KIND, "plural": PLURAL, "singular": "llamaserver"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}))

    def established() -> bool:
        crd = kube.apiext.read_custom_resource_definition(f"{PLURAL}.{GROUP}")
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
    wait_for(established, timeout=30, what=f"CRD {PLURAL}.{GROUP}")
    grant_operator_rbac(kubectl)


@pytest.fixture
def operator(cluster, kube, namespace, owner_crd, tmp_path):
    yield from running_operator(cluster.operator_kubeconfig, kube, namespace, tmp_path)


# Measured 41 s; the timeout is above the sum of its waits: 30 + 90 + 180 s and the teardown's 60 s.
@pytest.mark.timeout(420)
def test_a_deployment_a_custom_resource_controls_ends_recommended_naming_its_owner(kube, namespace, operator,
                                                                                   prometheus_url, wait_for):
    owner = kube.custom.create_namespaced_custom_object(GROUP, "v1", namespace, PLURAL, {
        "apiVersion": f"{GROUP}/v1", "kind": KIND, "metadata": {"name": "llama"}, "spec": {"args": []}})
    dep = production(namespace)
    dep["metadata"]["ownerReferences"] = [{"apiVersion": f"{GROUP}/v1", "kind": KIND, "name": "llama",
                                           "uid": owner["metadata"]["uid"], "controller": True,
                                           "blockOwnerDeletion": False}]
    kube.apps.create_namespaced_deployment(namespace, dep)
    wait_for(lambda: (kube.apps.read_namespaced_deployment("llm", namespace).status.ready_replicas or 0) >= 1,
             timeout=90, what="production ready")
    before = kube.apps.read_namespaced_deployment("llm", namespace)
    kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", batchtuning(
        namespace, prometheus_url, searchSpace={"maxNumSeqs": {"values": [16]}, "gpuMemoryUtilizationPercent": [95]},
        strategy={"type": "Grid", "maxTrials": 1, "maxParallelTrials": 1}, objective={"type": "OutputThroughput"},
        load={"inputTokens": 256, "outputTokens": 64, "concurrency": 4}, report={"curveLoad": {"concurrency": 4}},
        slo=LENIENT_SLO,  # what is asserted is not the SLO; measure 15 s: a window of 30-odd requests
        trial={"warmupSeconds": 3, "measureSeconds": 15, "readinessTimeoutSeconds": 90},
        apply={"mode": "Auto", "verifySeconds": 15, "cooldownSeconds": 0}))
    bt = wait_phase(kube, namespace, "tune", {"Recommended", "Succeeded", "Failed", "RolledBack"}, 180, operator)
    status = bt["status"]
    assert status["phase"] == "Recommended", json.dumps(status, indent=1)[-3000:]
    succeeded = condition(bt, "Succeeded")
    assert succeeded["reason"] == "TargetOwned"
    message = succeeded["message"]
    assert f"controlled by {KIND} llama ({GROUP}/v1)" in message and "would revert a patch" in message
    assert f"where the {KIND} takes them" in message and "spec.apply.mode Auto cannot override this" in message
    assert status["recommendation"]["args"]
    now = kube.apps.read_namespaced_deployment("llm", namespace)
    assert now.metadata.generation == before.metadata.generation  # never patched
    assert "batchtune.io/applied" not in (now.metadata.annotations or {})
    events = kube.core.list_namespaced_event(namespace, field_selector="involvedObject.name=tune").items
    assert any(e.reason == "TargetOwned" for e in events), [e.reason for e in events]
