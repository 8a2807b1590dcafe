"""The target Deployment is read from the API server only when the watch-fed index says it moved
(`kube.DeploymentCache`): the per-tick GET that the scale benchmark found is gone, and nothing stale is served."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from batchtune.controller import kube
from batchtune.controller.kube import DeploymentCache, Indexes, KubeCluster
from batchtune.controller.ports import Conflict


class Raw:
    """A response from `kube.request`, unread: the bytes as the API server sent them."""

    def __init__(self, obj: dict) -> None:
        self.data = json.dumps(obj).encode()

    def release_conn(self) -> None:
        pass


class FakeApps:
    """What the API server answers the port's Deployment requests (`kube.request`): one Deployment, its reads and
    patches counted."""

    store: dict[tuple[str, str], dict] = {}
    reads = 0
    conflict = False

    @staticmethod
    def request(method: str, path: str, path_params: dict, query=(), body=None, content_type=None, **_: object) -> Raw:
        assert path == "/apis/apps/v1/namespaces/{namespace}/deployments/{name}", path
        key = (path_params["namespace"], path_params["name"])
        if method == "GET":
            FakeApps.reads += 1
            if key not in FakeApps.store:
                raise ApiException(status=404)
            return Raw(FakeApps.store[key])
        assert method == "PATCH" and content_type == kube.STRATEGIC_MERGE
        if FakeApps.conflict:
            raise ApiException(status=409)
        dep = FakeApps.store[key]
        dep["metadata"]["resourceVersion"] = str(int(dep["metadata"]["resourceVersion"]) + 1)
        return Raw(dep)


@pytest.fixture
def cluster(monkeypatch):
    FakeApps.store = {("ns", "llm"): {"metadata": {"name": "llm", "namespace": "ns", "resourceVersion": "5"},
                                      "spec": {"replicas": 1}}}
    FakeApps.reads, FakeApps.conflict = 0, False
    monkeypatch.setattr(kube, "request", FakeApps.request)
    versions: dict[tuple[str, str], list[str]] = {("ns", "llm"): ["5"]}
    indexes = Indexes({}, {}, {}, deployment_versions=versions)
    return KubeCluster(indexes, "x", DeploymentCache()), versions


def test_an_unchanged_target_is_read_once(cluster):
    c, _ = cluster
    first = c.deployment("ns", "llm")
    for _ in range(10):
        assert c.deployment("ns", "llm") == first
    assert FakeApps.reads == 1


def test_a_copy_is_served_so_a_tick_cannot_change_the_cache(cluster):
    c, _ = cluster
    c.deployment("ns", "llm")["spec"]["replicas"] = 99
    assert c.deployment("ns", "llm")["spec"]["replicas"] == 1


def test_a_moved_resource_version_reads_again(cluster):
    c, versions = cluster
    c.deployment("ns", "llm")
    FakeApps.store[("ns", "llm")]["metadata"]["resourceVersion"] = "6"
    FakeApps.store[("ns", "llm")]["spec"]["replicas"] = 3
    versions[("ns", "llm")] = ["6"]
    assert c.deployment("ns", "llm")["spec"]["replicas"] == 3 and FakeApps.reads == 2
    assert c.deployment("ns", "llm")["spec"]["replicas"] == 3 and FakeApps.reads == 2


def test_a_watch_that_lags_costs_reads_not_staleness(cluster):
    """The index still says 5 while the server has 6: each tick reads (never serves 5 as current)."""
    c, _ = cluster
    FakeApps.store[("ns", "llm")]["metadata"]["resourceVersion"] = "6"
    assert c.deployment("ns", "llm")["metadata"]["resourceVersion"] == "6"
    assert c.deployment("ns", "llm")["metadata"]["resourceVersion"] == "6"
    assert FakeApps.reads == 2


def test_a_deployment_the_index_does_not_know_is_read_and_absent_is_none(cluster):
    c, versions = cluster
    versions.clear()
    assert c.deployment("ns", "llm") is not None and c.deployment("ns", "llm") is not None
    assert FakeApps.reads == 2  # never served from the cache without the index's word
    assert c.deployment("ns", "nope") is None


def test_a_patch_refreshes_the_cache_and_a_conflict_forgets_it(cluster):
    c, versions = cluster
    c.deployment("ns", "llm")
    patched = c.patch_deployment("ns", "llm", {"metadata": {"resourceVersion": "5"}}, "5")
    assert patched["metadata"]["resourceVersion"] == "6"
    versions[("ns", "llm")] = ["6"]
    assert c.deployment("ns", "llm")["metadata"]["resourceVersion"] == "6" and FakeApps.reads == 1
    FakeApps.conflict = True
    with pytest.raises(Conflict):
        c.patch_deployment("ns", "llm", {"metadata": {"resourceVersion": "6"}}, "6")
    c.deployment("ns", "llm")
    assert FakeApps.reads == 2


def test_the_cache_is_bounded():
    cache = DeploymentCache(limit=3)
    for i in range(5):
        cache.put({"metadata": {"namespace": "ns", "name": f"d{i}", "resourceVersion": "1"}})
    assert [cache.get("ns", f"d{i}", "1") is not None for i in range(5)] == [False, False, True, True, True]
