"""The local cluster's Service load balancer: which pods a Service routes to, and its address (pure parts)."""

from __future__ import annotations

import pytest

from batchtune_local.cluster import ClusterError, service_network_of
from batchtune_local.servicelb import Endpoint, endpoints, pick_address, ready, target_port


def pod(name: str, ip: str | None = "127.1.0.5", ready_: bool = True, phase: str = "Running",
        deleting: bool = False, labels: dict | None = None) -> dict:
    meta: dict = {"name": name, "labels": labels if labels is not None else {"app": "web"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta,
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready_ else "False"}]}}


SERVICE = {"spec": {"selector": {"app": "web"}}}


@pytest.mark.parametrize("p, serving", [
    (pod("a"), True), (pod("a", ready_=False), False), (pod("a", deleting=True), False),
    (pod("a", phase="Pending"), False), (pod("a", ip=None), False),
])
def test_only_ready_running_pods_that_are_not_terminating_serve(p, serving):
    assert ready(p) is serving


@pytest.mark.parametrize("port, expected", [
    ({"port": 8000, "targetPort": "http"}, 8080), ({"port": 8000, "targetPort": 9000}, 9000),
    ({"port": 8000, "targetPort": "9000"}, 9000), ({"port": 8000}, 8000), ({"port": 8000, "targetPort": "grpc"}, None),
])
def test_target_port_by_number_or_container_port_name(port, expected):
    assert target_port(port, pod("a")) == expected


def test_endpoints_are_the_selected_ready_pods():
    pods = [pod("a", "127.1.0.7"), pod("b", "127.1.0.6"), pod("c", "127.1.0.8", ready_=False),
            pod("d", "127.1.0.9", labels={"app": "other"}), pod("e", "127.1.0.10", labels={})]
    assert endpoints(SERVICE, {"port": 8000, "targetPort": "http"}, pods) == [
        Endpoint("127.1.0.6", 8080), Endpoint("127.1.0.7", 8080)]


def test_a_service_without_a_selector_routes_nowhere():
    assert endpoints({"spec": {}}, {"port": 8000}, [pod("a")]) == []


def test_addresses_are_stable_and_unique():
    assert pick_address("127.1.255.0/24", set(), None) == "127.1.255.1"
    assert pick_address("127.1.255.0/24", {"127.1.255.1"}, None) == "127.1.255.2"
    assert pick_address("127.1.255.0/24", {"127.1.255.1"}, "127.1.255.9") == "127.1.255.9"
    assert pick_address("127.1.255.0/24", set(), "127.9.0.1") == "127.1.255.1"  # not ours: reassigned
    assert pick_address("127.1.255.0/30", {"127.1.255.1", "127.1.255.2"}, None) is None


def test_service_network_is_the_pod_networks_last_slash_24():
    assert service_network_of("127.20.0.0/16") == "127.20.255.0/24"
    assert service_network_of("127.1.0.0/23") == "127.1.1.0/24"
    with pytest.raises(ClusterError, match="/23 or larger"):
        service_network_of("127.1.0.0/24")
