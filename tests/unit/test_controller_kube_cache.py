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
    """A response requested with `_preload_content=False`: the bytes as the API server sent them."""

    def __init__(self, obj: dict) -> None:
        self.data = json.dumps(obj).encode()

    def release_conn(self) -> None:
        pass


class FakeApps:
    """What `client.AppsV1Api(api())` answers, read raw as the operator asks: one Deployment, its reads and patches
    counted."""

    store: dict[tuple[str, str], dict] = {}
    reads = 0
    conflict = False

    def __init__(self, _api: object = None) -> None:
        pass

    def read_namespaced_deployment(self, name: str, namespace: str, _preload_content: bool = True) -> Raw:
        assert _preload_content is False, "read raw: no model classes"
        FakeApps.reads += 1
        if (namespace, name) not in FakeApps.store:
            raise ApiException(status=404)
        return Raw(FakeApps.store[(namespace, name)])

    def patch_namespaced_deployment(self, name: str, namespace: str, patch: dict, field_manager: str,
                                    _preload_content: bool = True) -> Raw:
        assert _preload_content is False, "read raw: no model classes"
        if FakeApps.conflict:
            raise ApiException(status=409)
        dep = FakeApps.store[(namespace, name)]
        dep["metadata"]["resourceVersion"] = str(int(dep["metadata"]["resourceVersion"]) + 1)
        return Raw(dep)


@pytest.fixture
def cluster(monkeypatch):
    FakeApps.store = {("ns", "llm"): {"metadata": {"name": "llm", "namespace": "ns", "resourceVersion": "5"},
                                      "spec": {"replicas": 1}}}
    FakeApps.reads, FakeApps.conflict = 0, False
    monkeypatch.setattr(kube.client, "AppsV1Api", FakeApps)
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
