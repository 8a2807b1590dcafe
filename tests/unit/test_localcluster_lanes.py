"""Lanes: every checkout and xdist worker gets state directories and loopback networks no other lane uses."""

from __future__ import annotations

import ipaddress
import itertools
from pathlib import Path

import pytest

from batchtune_local import lanes
from batchtune_local.cluster import service_network_of


def every_lane() -> list[lanes.Lane]:
    return [lanes.Lane(c, w) for c in range(lanes.MAX_CHECKOUT + 1) for w in range(lanes.MAX_WORKER + 1)]


def test_no_two_networks_of_any_lanes_overlap():
    networks = [ipaddress.ip_network("127.1.0.0/16")]  # the node agent's default: the classic twin cluster
    for lane in every_lane():
        if not lane.classic:
            networks.append(ipaddress.ip_network(lanes.pod_network(lane)))
        networks.append(ipaddress.ip_network(lanes.real_pod_network(lane)))
        networks.append(ipaddress.ip_network(lanes.scratch_network(lane)))
    loopback = ipaddress.ip_network("127.0.0.0/8")
    assert all(n.subnet_of(loopback) and n.prefixlen <= 23 for n in networks)
    ordered = sorted(networks, key=lambda n: int(n.network_address))
    for a, b in itertools.pairwise(ordered):  # sorted by start: disjoint iff each ends before the next starts
        assert a.broadcast_address < b.network_address, (a, b)


def test_every_pod_network_leaves_room_for_the_service_pool():
    for lane in every_lane():
        net = lanes.pod_network(lane) or "127.1.0.0/16"
        pool = ipaddress.ip_network(service_network_of(net))
        assert pool.subnet_of(ipaddress.ip_network(net))


def test_state_directories_are_distinct(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHTUNE_CLUSTER_DIR", str(tmp_path / "cluster"))
    monkeypatch.setenv("BATCHTUNE_REAL_CLUSTER_DIR", str(tmp_path / "real"))
    dirs = [lanes.cluster_dir(lane) for lane in every_lane()] + [lanes.real_cluster_dir(lane) for lane in every_lane()]
    assert len(set(dirs)) == len(dirs)
    assert lanes.cluster_dir(lanes.Lane()) == tmp_path / "cluster"
    assert lanes.real_cluster_dir(lanes.Lane()) == tmp_path / "real"


@pytest.mark.parametrize(("lane_var", "worker", "expected"), [
    pytest.param(None, None, lanes.Lane(0, 0), id="classic"),
    pytest.param("7", None, lanes.Lane(7, 0), id="checkout"),
    pytest.param(None, "gw0", lanes.Lane(0, 1), id="first-worker"),
    pytest.param("3", "gw4", lanes.Lane(3, 5), id="both"),
    pytest.param("", "master", lanes.Lane(0, 0), id="xdist-controller"),
])
def test_current_lane_from_the_environment(monkeypatch, lane_var, worker, expected):
    for name, value in (("BATCHTUNE_LANE", lane_var), ("PYTEST_XDIST_WORKER", worker)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert lanes.current() == expected


@pytest.mark.parametrize(("name", "value", "words"), [
    pytest.param("BATCHTUNE_LANE", "x", "BATCHTUNE_LANE='x'", id="not-a-number"),
    pytest.param("BATCHTUNE_LANE", "50", "0..49", id="too-large"),
    pytest.param("PYTEST_XDIST_WORKER", "gw15", "at most 15", id="too-many-workers"),
])
def test_a_bad_lane_names_the_variable(monkeypatch, name, value, words):
    monkeypatch.delenv("BATCHTUNE_LANE", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        lanes.current()


def test_the_classic_lane_keeps_the_old_places(monkeypatch):
    monkeypatch.delenv("BATCHTUNE_CLUSTER_DIR", raising=False)
    monkeypatch.delenv("BATCHTUNE_REAL_CLUSTER_DIR", raising=False)
    classic = lanes.Lane()
    assert lanes.cluster_dir(classic) == Path.home() / ".cache" / "batchtune" / "cluster"
    assert lanes.real_cluster_dir(classic) == Path("/tmp/bt-real-cluster")
    assert (lanes.pod_network(classic), lanes.real_pod_network(classic)) == (None, "127.40.0.0/16")
