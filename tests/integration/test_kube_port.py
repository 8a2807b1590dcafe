"""The cluster port (`controller.kube.KubeCluster`) against a real API server: every read and write it makes raw
(the API server's JSON, no model classes) answers what the port promises."""

from __future__ import annotations

import base64
import time

import pytest

from batchtune.controller import kube as kube_port
from batchtune.controller.kube import DeploymentCache, Indexes, KubeCluster
from batchtune.controller.ports import Conflict, NotAllowed

pytestmark = [pytest.mark.integration]

LABEL = "batchtune.io/secret-test"


@pytest.fixture
def port(kube, monkeypatch):
    monkeypatch.setattr(kube_port, "_CLIENT", kube.api)  # the cluster admin's client, in this process
    return KubeCluster(Indexes({}, {}, {}), LABEL, DeploymentCache())


def deployment(namespace: str) -> dict:
    labels = {"app": "raw"}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "raw", "namespace": namespace},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "c", "image": "registry.invalid/none:1",
                                                           "args": ["--max-num-seqs", "8"]}]}}}}


@pytest.mark.timeout(120)
def test_reads_and_writes_as_the_api_servers_json(kube, namespace, port, wait_for):
    from kubernetes import client

    assert port.create(deployment(namespace)) is True
    assert port.create(deployment(namespace)) is False  # exists: 409, not an error
    found = port.deployment(namespace, "raw")
    assert found is not None and found["metadata"]["name"] == "raw"
    assert found["spec"]["template"]["spec"]["containers"][0]["args"] == ["--max-num-seqs", "8"]
    assert str(found["metadata"]["creationTimestamp"]).endswith("Z")  # as the API server writes it, like kopf's
    assert port.deployment(namespace, "absent") is None

    # The Deployment controller writes its status meanwhile: a patch on a version it moved past is refused (409),
    # and one on the version just read goes through.
    patched = None
    for _ in range(20):
        version = (port.deployment(namespace, "raw") or {})["metadata"]["resourceVersion"]
        patch = {"metadata": {"resourceVersion": version, "annotations": {"batchtune.io/raw": "1"}}}
        try:
            patched = port.patch_deployment(namespace, "raw", patch, version)
            break
        except Conflict:
            time.sleep(0.5)
    assert patched is not None, "every patch conflicted"
    assert patched["metadata"]["annotations"]["batchtune.io/raw"] == "1"
    assert patched["metadata"]["resourceVersion"] != version
    with pytest.raises(Conflict):
        port.patch_deployment(namespace, "raw", patch, version)

    def replica_set():
        items = kube.apps.list_namespaced_replica_set(namespace).items
        return items[0] if items else None
    wait_for(replica_set, timeout=60, what="the Deployment's ReplicaSet")
    rs = replica_set()
    assert port.replica_set_controller(namespace, rs.metadata.name, rs.metadata.uid) == found["metadata"]["uid"]
    assert port.replica_set_controller(namespace, rs.metadata.name, "another-uid") is None

    wait_for(lambda: port.production_pods(namespace, {"matchLabels": {"app": "raw"}}), timeout=60,
             what="the Deployment's pod")
    pod = port.production_pods(namespace, {"matchLabels": {"app": "raw"}})[0]
    assert pod["metadata"]["labels"]["app"] == "raw" and pod["spec"]["containers"][0]["name"] == "c"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == rs.metadata.uid

    kube.core.create_namespaced_service(namespace, {"metadata": {"name": "raw"},
                                                    "spec": {"selector": {"app": "raw"}, "ports": [{"port": 80}]}})
    assert {"spec": {"selector": {"app": "raw"}}} in port.services(namespace)

    for name, labels in (("opted-in", {LABEL: "true"}), ("not-opted-in", {})):
        kube.core.create_namespaced_secret(namespace, client.V1Secret(
            metadata=client.V1ObjectMeta(name=name, labels=labels),
            data={"token": base64.b64encode(b"s3cret").decode()}))
    assert port.secret_value(namespace, "opted-in", "token") == "s3cret"
    with pytest.raises(NotAllowed, match="has not opted in"):
        port.secret_value(namespace, "not-opted-in", "token")
    with pytest.raises(NotAllowed, match="has no key 'other'"):
        port.secret_value(namespace, "opted-in", "other")

    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "raw-report", "namespace": namespace},
              "data": {"a": "1"}}
    kube_port.upsert_configmap(config)  # created
    kube_port.upsert_configmap({**config, "data": {"a": "2"}})  # replaced
    assert kube.core.read_namespaced_config_map("raw-report", namespace).data == {"a": "2"}

    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "raw-job", "namespace": namespace},
           "spec": {"template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "registry.invalid/none:1"}]}}}}
    assert port.create(job) is True
    port.delete("Job", namespace, "raw-job")
    port.delete("Job", namespace, "raw-job")  # gone already: not an error
    port.delete("Deployment", namespace, "raw")
    wait_for(lambda: port.deployment(namespace, "raw") is None
             or (port.deployment(namespace, "raw") or {}).get("metadata", {}).get("deletionTimestamp"),
             timeout=30, what="the Deployment deleted")
