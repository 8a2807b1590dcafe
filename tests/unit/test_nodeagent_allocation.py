"""Pod IP and GPU allocation, and their persistence across agent restarts."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchtune_local.nodeagent.allocation import OutOfAddresses, allocate_gpus, allocate_ip, gpu_limit
from batchtune_local.nodeagent.state import InsufficientGpus, StateStore


@pytest.mark.parametrize(
    "network, used, after, expected",
    [
        pytest.param("127.1.0.0/16", [], None, "127.1.0.1", id="first-skips-network-address"),
        pytest.param("127.1.0.0/16", ["127.1.0.1"], None, "127.1.0.2", id="skips-used"),
        pytest.param("127.1.0.0/16", [], "127.1.0.7", "127.1.0.8", id="next-fit-after-last"),
        pytest.param("127.1.0.0/16", [], "127.1.0.254", "127.1.1.1", id="skips-255-and-0"),
        pytest.param("127.0.0.0/30", [], None, "127.0.0.2", id="never-127.0.0.1"),
        pytest.param("127.9.9.0/30", ["127.9.9.1", "127.9.9.2"], "127.9.9.2", "127.9.9.3", id="wraps"),
    ],
)
def test_allocate_ip(network, used, after, expected):
    assert allocate_ip(network, used, after) == expected


def test_allocate_ip_exhausted_names_the_network():
    with pytest.raises(OutOfAddresses, match="127.9.9.0/30"):
        allocate_ip("127.9.9.0/30", ["127.9.9.1", "127.9.9.2", "127.9.9.3"])


def test_allocate_ip_rejects_non_loopback():
    with pytest.raises(ValueError, match="10.0.0.0/8"):
        allocate_ip("10.0.0.0/8", [])


@given(st.sets(st.integers(min_value=1, max_value=200), max_size=50))
def test_allocate_ip_is_loopback_and_unused(taken_hosts):
    used = {f"127.5.0.{h}" for h in taken_hosts}
    ip = allocate_ip("127.5.0.0/24", used)
    assert ip not in used
    assert ipaddress.ip_address(ip).is_loopback and ip != "127.0.0.1"


@pytest.mark.parametrize(
    "total, held, count, expected",
    [
        pytest.param(8, [], 1, [0], id="lowest-free"),
        pytest.param(8, [0, 1, 3], 2, [2, 4], id="fills-holes"),
        pytest.param(8, list(range(7)), 2, None, id="too-few"),
        pytest.param(8, list(range(8)), 0, [], id="zero-always-fits"),
    ],
)
def test_allocate_gpus(total, held, count, expected):
    assert allocate_gpus(total, held, count) == expected


@pytest.mark.parametrize(
    "container, expected",
    [
        pytest.param({"resources": {"limits": {"nvidia.com/gpu": 2}}}, 2, id="limit-int"),
        pytest.param({"resources": {"limits": {"nvidia.com/gpu": "4"}}}, 4, id="limit-str"),
        pytest.param({"resources": {"requests": {"nvidia.com/gpu": "1"}}}, 1, id="request-only"),
        pytest.param({}, 0, id="none"),
    ],
)
def test_gpu_limit(container, expected):
    assert gpu_limit(container) == expected


def test_gpu_limit_error_names_field_and_value():
    with pytest.raises(ValueError, match=r"limits\['nvidia.com/gpu'\].*'one'"):
        gpu_limit({"name": "c", "resources": {"limits": {"nvidia.com/gpu": "one"}}})


def test_store_keeps_allocations_across_restart(tmp_path):
    store = StateStore(tmp_path, "127.1.0.0/16")
    a = store.admit("uid-a", "ns", "a", "n0", {"main": 2}, 8, 1.0)
    b = store.admit("uid-b", "ns", "b", "n0", {"main": 1}, 8, 2.0)
    assert (a["gpus"], b["gpus"]) == ({"main": [0, 1]}, {"main": [2]})
    assert a["ip"] != b["ip"]
    again = StateStore(tmp_path, "127.1.0.0/16")
    assert again.pod("uid-a") == a
    assert again.admit("uid-a", "ns", "a", "n0", {"main": 2}, 8, 3.0) == a  # idempotent
    c = again.admit("uid-c", "ns", "c", "n0", {}, 8, 4.0)
    assert c["ip"] not in (a["ip"], b["ip"])


def test_store_frees_gpus_on_release_and_refuses_overcommit(tmp_path):
    store = StateStore(tmp_path, "127.1.0.0/16")
    store.admit("uid-a", "ns", "a", "n0", {"main": 8}, 8, 1.0)
    with pytest.raises(InsufficientGpus, match="needs 1 nvidia.com/gpu, node n0 has 0 free"):
        store.admit("uid-b", "ns", "b", "n0", {"main": 1}, 8, 2.0)
    assert store.admit("uid-x", "ns", "x", "n1", {"main": 1}, 8, 2.0)["gpus"] == {"main": [0]}  # other node
    store.release_gpus("uid-a")
    assert store.admit("uid-b", "ns", "b", "n0", {"main": 1}, 8, 3.0)["gpus"] == {"main": [0]}
    assert store.gpu_holders("n0") == {0: ("uid-b", "main")}
