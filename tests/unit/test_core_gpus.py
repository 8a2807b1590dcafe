"""GPU accounting: how many more trials fit, per node, with unbound pods and intents placed first."""

from __future__ import annotations

import pytest

from batchtune.core.gpus import NodeGpus, container_gpus, eligible_nodes, node_usage, pod_gpus, trials_that_fit


def _nodes(*free: int) -> list[NodeGpus]:
    return [NodeGpus(f"n{i}", f, 0) for i, f in enumerate(free)]


@pytest.mark.parametrize("usage, pending, per_trial, fits", [
    pytest.param(_nodes(8), [], 1, 8, id="one-node"),
    pytest.param([NodeGpus("a", 8, 6)], [], 1, 2, id="used-gpus-held"),
    pytest.param([NodeGpus("a", 4, 6)], [], 1, 0, id="overcommitted-node-has-none"),
    pytest.param(_nodes(1, 1), [], 2, 0, id="two-gpu-trial-needs-two-on-one-node"),
    pytest.param(_nodes(1, 1, 2), [], 2, 1, id="two-gpu-trial-on-the-node-that-has-two"),
    pytest.param(_nodes(3, 3), [], 2, 2, id="odd-remainders-are-wasted"),
    pytest.param(_nodes(2), [1], 1, 1, id="unbound-pod-placed-first"),
    pytest.param(_nodes(1, 2), [1], 2, 1, id="best-fit-keeps-the-big-hole"),
    pytest.param(_nodes(3, 2), [1, 2], 2, 1, id="largest-demand-placed-first"),
    pytest.param(_nodes(1, 1), [2], 1, 0, id="unplaceable-demand-still-waits"),
    pytest.param(_nodes(4, 1), [4, 4], 1, 0, id="more-demand-than-gpus"),
    pytest.param([], [], 1, 0, id="no-nodes"),
])
def test_trials_that_fit(usage, pending, per_trial, fits):
    assert trials_that_fit(usage, pending, per_trial) == fits


def test_free_gpus_are_counted_not_assumed():
    # A free count standing in for "unknown" (say 10**6) would let every trial start at once.
    assert trials_that_fit([NodeGpus("a", 2, 0)], [], 1) == 2
    assert trials_that_fit([NodeGpus("a", 2, 2)], [], 1) == 0
    assert trials_that_fit([NodeGpus("a", 0, 0)], [], 1) == 0


def test_a_trial_needs_a_gpu():
    with pytest.raises(ValueError, match="at least one GPU"):
        trials_that_fit(_nodes(8), [], 0)


def _node(name: str, gpus: int | str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {"nvidia.com/gpu": gpus}}}


def _gpu_pod(gpus: int, node: str | None = None, phase: str = "Running") -> dict:
    spec = {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if node:
        spec["nodeName"] = node
    return {"spec": spec, "status": {"phase": phase}}


def test_node_usage_and_eligible_nodes():
    nodes = [_node("a", "8", pool="gpu", **{"nvidia.com/gpu.product": "H100"}),
             _node("b", "8", pool="gpu", **{"nvidia.com/gpu.product": "A100"}),
             _node("c", "0", pool="gpu", **{"nvidia.com/gpu.product": "H100"}),
             _node("d", "8", pool="cpu", **{"nvidia.com/gpu.product": "H100"})]
    eligible = eligible_nodes(nodes, {"pool": "gpu"}, "H100")
    assert [n["metadata"]["name"] for n in eligible] == ["a"]
    pods = [_gpu_pod(2, "a"), _gpu_pod(1, "a", phase="Succeeded"), _gpu_pod(4, "b"), _gpu_pod(3), _gpu_pod(0)]
    usage, unbound = node_usage(eligible, pods)
    assert usage == [NodeGpus("a", 8, 2)] and unbound == [3]
    assert trials_that_fit(usage, unbound, 2) == 1


@pytest.mark.parametrize("container, gpus", [
    pytest.param({"resources": {"limits": {"nvidia.com/gpu": "2"}}}, 2, id="limit"),
    pytest.param({"resources": {"requests": {"nvidia.com/gpu": 1}}}, 1, id="request"),
    pytest.param({"resources": {"limits": {"nvidia.com/gpu": "lots"}}}, 0, id="junk"),
    pytest.param({}, 0, id="none"),
])
def test_container_gpus(container, gpus):
    assert container_gpus(container) == gpus
    assert pod_gpus({"spec": {"containers": [container, container]}}) == 2 * gpus


# ---- cases mutation testing (hack/mutation-test) showed no test would notice -----------------------

def _node(name: str, gpus: int, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def _pod(node: str | None, gpus: int, phase: str = "Running") -> dict:
    return {"spec": {"nodeName": node, "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def test_pending_demands_take_the_tightest_hole_that_fits():
    # A 2-GPU pod waiting to be scheduled goes where 2 are free, keeping the 4-GPU hole for a 4-GPU trial.
    from batchtune.core.gpus import NodeGpus, trials_that_fit

    usage = [NodeGpus("big", 8, 4), NodeGpus("small", 8, 6)]
    assert trials_that_fit(usage, [2], 4) == 1


def test_finished_pods_hold_no_gpus():
    from batchtune.core.gpus import node_usage

    nodes = [_node("n0", 8)]
    usage, unbound = node_usage(nodes, [_pod("n0", 4, "Failed"), _pod("n0", 2, "Succeeded"), _pod("n0", 1)])
    assert usage[0].used == 1 and unbound == []


def test_a_node_that_does_not_match_does_not_hide_the_ones_after_it():
    from batchtune.core.gpus import eligible_nodes

    nodes = [_node("cpu", 0), _node("other", 8, **{"nvidia.com/gpu.product": "NVIDIA-A100"}),
             _node("h100", 8, **{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"})]
    assert [n["metadata"]["name"] for n in eligible_nodes(nodes, {}, "NVIDIA-H100-80GB-HBM3")] == ["h100"]
