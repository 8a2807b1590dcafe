"""The cluster port (`controller.kube`) and the leader Lease (`controller.leader.KubeLease`) call the API server by path
through the client's `ApiClient`: each call sends, byte for byte, the request the kubernetes client's typed API classes
sent for it (method, path and query, Accept, Content-Type, body), answers the same, fails the same, and loads none of
the client's API or model modules (~26 MB of the operator's RSS on its first tick; `hack/bench-operator-memory
kubeport`). Against a loopback stand-in of the API server (`fake_apiserver`)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from batchtune.controller import kube, leader
from batchtune.controller.kube import DeploymentCache, Indexes, KubeCluster
from batchtune.controller.ports import Conflict, NotAllowed
from batchtune.core.lease import LeaseRecord

SECRET_LABEL = "batchtune.io/secret"


@pytest.fixture
def wire(monkeypatch):
    fake = FakeApiServer()
    with fake.serving() as url:
        api_client = client.ApiClient(client.Configuration(host=url))
        monkeypatch.setattr(kube, "_CLIENT", api_client)
        yield fake, api_client
        api_client.close()


def sent(fake: FakeApiServer, call) -> tuple[object, list[tuple]]:
    """What `call` returned and the requests it sent."""
    before = len(fake.requests)
    result = call()
    return result, [r.key() for r in fake.requests[before:]]


def port() -> KubeCluster:
    return KubeCluster(Indexes({}, {}, {}), SECRET_LABEL, DeploymentCache())


def test_reads_send_what_the_typed_reads_sent_and_answer_the_json(wire):
    fake, api_client = wire
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    custom = client.CustomObjectsApi(api_client)
    selector = {"matchLabels": {"app": "llm"}, "matchExpressions": [{"key": "tier", "operator": "In",
                                                                      "values": ["a", "b"]}]}
    cases = [
        (lambda: port().deployment("ns", "llm"),
         lambda: apps.read_namespaced_deployment("llm", "ns", _preload_content=False)),
        (lambda: port().replica_set_controller("ns", "rs", "uid-rs"),
         lambda: apps.read_namespaced_replica_set("rs", "ns", _preload_content=False)),
        (lambda: port().production_pods("ns", selector),
         lambda: core.list_namespaced_pod("ns", label_selector=kube.selector_text(selector), _preload_content=False)),
        (lambda: port().services("ns"), lambda: core.list_namespaced_service("ns", _preload_content=False)),
        (lambda: port().batchtuning("ns", "tune"),
         lambda: custom.get_namespaced_custom_object("batchtune.io", "v1alpha1", "ns", "batchtunings", "tune",
                                                     _preload_content=False)),
        (lambda: port().secret_value("ns", "token", "token"),
         lambda: core.read_namespaced_secret("token", "ns", _preload_content=False)),
    ]
    for ours, typed in cases:
        answer, requests = sent(fake, ours)
        _, expected = sent(fake, typed)
        assert requests == expected and len(requests) == 1
        assert answer
    assert port().replica_set_controller("ns", "rs", "uid-rs") == "uid-llm"
    assert [p["metadata"]["name"] for p in port().production_pods("ns", selector)] == ["llm-0", "llm-1"]
    assert port().services("ns") == [{"spec": {"selector": {"app": "llm"}}}]
    assert port().secret_value("ns", "token", "token") == "secret"
    assert port().batchtuning("ns", "tune")["metadata"]["resourceVersion"] == "7"


def test_a_read_answers_the_api_servers_json_as_is(wire):
    fake, _ = wire
    expected = json.loads(fake.answer("GET", "/apis/apps/v1/namespaces/ns/deployments/llm", None)[2])
    assert port().deployment("ns", "llm") == expected  # managedFields, quantities and timestamps as the server wrote


def test_a_container_log_is_the_text_the_typed_read_returned(wire):
    fake, api_client = wire
    core = client.CoreV1Api(api_client)
    for previous in (False, True):
        text, requests = sent(fake, lambda p=previous: port().container_log("ns", "llm-0", "vllm", p))
        typed, expected = sent(fake, lambda p=previous: core.read_namespaced_pod_log(
            "llm-0", "ns", container="vllm", previous=p, tail_lines=kube.LOG_TAIL_LINES,
            limit_bytes=kube.LOG_LIMIT_BYTES))
        assert requests == expected
        assert text == typed and "\u2013" in str(text)
    fake.status["/api/v1/namespaces/ns/pods/gone/log"] = 404
    assert port().container_log("ns", "gone", "vllm", True) is None


def test_writes_send_what_the_typed_writes_sent(wire):
    fake, api_client = wire
    apps, batch, core = client.AppsV1Api(api_client), client.BatchV1Api(api_client), client.CoreV1Api(api_client)
    dep = port().deployment("ns", "llm")
    assert dep is not None
    bodies = {
        "Deployment": {"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"namespace": "ns", "name": "t", "labels": {"a": "b"}}, "spec": dep["spec"]},
        "Job": {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"namespace": "ns", "name": "j"},
                "spec": {"backoffLimit": 0, "template": dep["spec"]["template"]}},
        "ConfigMap": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "c"},
                      "data": {"trials.json": "{}"}},
    }
    typed_create = {"Deployment": apps.create_namespaced_deployment, "Job": batch.create_namespaced_job,
                    "ConfigMap": core.create_namespaced_config_map}
    for kind, body in bodies.items():
        created, requests = sent(fake, lambda b=body: port().create(b))
        _, expected = sent(fake, lambda k=kind, b=body: typed_create[k]("ns", dict(b), field_manager=kube.FIELD_MANAGER,
                                                                       _preload_content=False))
        assert requests == expected and created is True
    patch = {"metadata": {"resourceVersion": "5", "annotations": {"batchtune.io/applied": "x"}},
             "spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": ["--max-num-seqs", "8"]}]}}}}
    patched, requests = sent(fake, lambda: port().patch_deployment("ns", "llm", patch, "5"))
    _, expected = sent(fake, lambda: apps.patch_namespaced_deployment("llm", "ns", dict(patch),
                                                                      field_manager=kube.FIELD_MANAGER,
                                                                      _preload_content=False))
    assert requests == expected
    assert fake.requests[-1].content_type == kube.STRATEGIC_MERGE
    assert patched["metadata"]["annotations"]["batchtune.io/applied"] == "x"
    _, requests = sent(fake, lambda: port().delete("Deployment", "ns", "t"))
    _, expected = sent(fake, lambda: apps.delete_namespaced_deployment(
        "t", "ns", propagation_policy="Background", grace_period_seconds=5, _preload_content=False))
    assert requests == expected
    _, requests = sent(fake, lambda: port().delete("Job", "ns", "j"))
    _, expected = sent(fake, lambda: batch.delete_namespaced_job("j", "ns", propagation_policy="Background",
                                                                 _preload_content=False))
    assert requests == expected
    cm = bodies["ConfigMap"]
    _, requests = sent(fake, lambda: kube.upsert_configmap(cm))
    _, expected = sent(fake, lambda: core.replace_namespaced_config_map("c", "ns", dict(cm),
                                                                        field_manager=kube.FIELD_MANAGER,
                                                                        _preload_content=False))
    assert requests == expected


def test_failures_are_the_typed_calls_failures(wire):
    fake, api_client = wire
    apps = client.AppsV1Api(api_client)
    for code, exc_type in ((404, client.exceptions.NotFoundException), (409, client.exceptions.ConflictException),
                           (403, client.exceptions.ForbiddenException), (500, ApiException)):
        fake.status["/apis/apps/v1/namespaces/ns/deployments/llm"] = code
        with pytest.raises(ApiException) as ours:
            kube.request("GET", "/apis/apps/v1/namespaces/{namespace}/deployments/{name}", {"namespace": "ns",
                                                                                            "name": "llm"})
        with pytest.raises(ApiException) as typed:
            apps.read_namespaced_deployment("llm", "ns", _preload_content=False)
        assert type(ours.value) is type(typed.value) and isinstance(ours.value, exc_type)
        assert (ours.value.status, ours.value.reason, ours.value.body) == (typed.value.status, typed.value.reason,
                                                                           typed.value.body)
    fake.status["/apis/apps/v1/namespaces/ns/deployments/llm"] = 404
    assert port().deployment("ns", "llm") is None
    fake.status["/apis/batchtune.io/v1alpha1/namespaces/ns/batchtunings/gone"] = 404
    assert port().batchtuning("ns", "gone") is None
    fake.status["/apis/batchtune.io/v1alpha1/namespaces/ns/batchtunings/gone"] = 500
    with pytest.raises(ApiException):
        port().batchtuning("ns", "gone")
    fake.status["/apis/apps/v1/namespaces/ns/deployments/llm"] = 409
    with pytest.raises(Conflict):
        port().patch_deployment("ns", "llm", {"metadata": {"resourceVersion": "5"}}, "5")
    fake.status["/apis/apps/v1/namespaces/ns/deployments"] = 409
    assert port().create({"kind": "Deployment", "metadata": {"namespace": "ns", "name": "llm"}}) is False
    fake.status["/api/v1/namespaces/ns/secrets/token"] = 403
    with pytest.raises(NotAllowed, match="HTTP 403"):
        port().secret_value("ns", "token", "token")
    fake.status["/api/v1/namespaces/ns/configmaps/c"] = 404
    before = len(fake.requests)
    kube.upsert_configmap({"metadata": {"namespace": "ns", "name": "c"}, "data": {}})
    assert [(r.method, r.target) for r in fake.requests[before:]] == [
        ("PUT", "/api/v1/namespaces/ns/configmaps/c?fieldManager=batchtune"),
        ("POST", "/api/v1/namespaces/ns/configmaps?fieldManager=batchtune")]


def respelled(request: tuple) -> tuple:
    """A recorded Lease write with its spec's times as datetimes (the spelling aside)."""
    body = json.loads(request[4])
    for key in ("acquireTime", "renewTime"):
        body["spec"][key] = datetime.fromisoformat(body["spec"][key].replace("Z", "+00:00"))
    return (*request[:4], body)


def test_the_lease_is_read_and_written_as_the_typed_client_did(wire):
    fake, api_client = wire
    coord = client.CoordinationV1Api(api_client)
    leases = leader.KubeLease("ns", "batchtune-operator", api_client)
    record, requests = sent(fake, leases.get)
    typed, expected = sent(fake, lambda: coord.read_namespaced_lease("batchtune-operator", "ns", _request_timeout=5))
    assert requests == expected
    assert record == LeaseRecord("replica-a", 15, typed.spec.acquire_time, typed.spec.renew_time, 2, "1")
    assert record.renew_time == datetime(2026, 12, 3, 12, 0, 10, 123456, tzinfo=UTC)
    now = datetime(2026, 12, 3, 13, 0, 0, 5, tzinfo=UTC)
    mine = LeaseRecord("me", 15, now, now, 3, "1")
    for ours, theirs in ((lambda: leases.replace(mine), lambda: coord.replace_namespaced_lease(
                              "batchtune-operator", "ns", leases._body(mine), _request_timeout=5)),
                         (lambda: leases.create(mine), lambda: coord.create_namespaced_lease(
                              "ns", leases._body(mine), _request_timeout=5))):
        written, requests = sent(fake, ours)
        _, expected = sent(fake, theirs)
        # One difference, on purpose: the typed call turned the body into its V1Lease model and wrote the times back
        # as "+00:00" (and without the fraction when the microseconds are 0, which MicroTime's RFC3339Micro refuses);
        # the body now goes as `_body` spells it, "Z" and six digits. The same instants, everything else the same.
        assert [respelled(r) for r in requests] == [respelled(r) for r in expected]
        assert '"renewTime": "2026-12-03T13:00:00.000005Z"' in requests[0][4]
        assert written.holder == "me" and written.acquire_time == now
    fake.status["/apis/coordination.k8s.io/v1/namespaces/ns/leases/batchtune-operator"] = 404
    assert leases.get() is None
    fake.status["/apis/coordination.k8s.io/v1/namespaces/ns/leases/batchtune-operator"] = 409
    with pytest.raises(leader.LeaseConflict):
        leases.replace(mine)


CALLS = """
import sys
sys.path.insert(0, sys.argv[1])
from fake_apiserver import FakeApiServer
from kubernetes import client
from batchtune.controller import handlers, kube, telemetry
from batchtune.controller.kube import DeploymentCache, Indexes, KubeCluster
from batchtune.controller.leader import KubeLease

fake = FakeApiServer()
with fake.serving() as url:
    client.Configuration.set_default(client.Configuration(host=url))
    port = KubeCluster(Indexes({}, {}, {}), "batchtune.io/secret", DeploymentCache())
    dep = port.deployment("ns", "llm")
    port.replica_set_controller("ns", "rs", "uid-rs")
    port.production_pods("ns", {"matchLabels": {"app": "llm"}})
    port.services("ns")
    port.container_log("ns", "llm-0", "vllm", False)
    port.secret_value("ns", "token", "token")
    port.batchtuning("ns", "tune")
    for kind in ("Deployment", "Job", "ConfigMap"):
        port.create({"kind": kind, "metadata": {"namespace": "ns", "name": "x"}, "spec": dep["spec"]})
    kube.upsert_configmap({"kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "c"}, "data": {}})
    port.patch_deployment("ns", "llm", {"metadata": {"resourceVersion": "5"}}, "5")
    port.delete("Deployment", "ns", "x")
    port.delete("Job", "ns", "x")
    leases = KubeLease("ns", "l")
    leases.replace(leases.get())
    assert len(fake.requests) == 16, len(fake.requests)
print(sorted(m for m in sys.modules if m.startswith(("kubernetes.client.api.", "kubernetes.client.models.v1_pod",
                                                     "kubernetes.client.models.v1_deployment",
                                                     "kubernetes.client.models.v1_lease"))))
"""


@pytest.mark.timeout(400)  # about 1.5 s of CPU; minutes of wall time on a starved machine
def test_the_ports_calls_load_none_of_the_clients_api_or_model_modules():
    # A fresh operator process: its imports, then every call the cluster port and the Lease make.
    here = str(Path(__file__).parent)
    done = subprocess.run([sys.executable, "-c", CALLS, here], capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
