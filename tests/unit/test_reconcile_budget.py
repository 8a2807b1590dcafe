"""The GPU budget is a ceiling over a BatchTuning's life, and every accelerator counts (issue 22, section 5).

The world's trial pods each hold one device; `held` adds up what they hold tick by tick, independently of what
the operator writes to status, so the ceiling is checked against the world, not against the operator's own figure.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from fake_world import World, fresh_backoff, production_target, spec  # noqa: F401  # the fixture, through pytestmark

from batchtune.core.gpus import TrialDevices, eligible_nodes, node_usage, trial_devices

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
pytestmark = pytest.mark.usefixtures("fresh_backoff")


def world(**overrides) -> World:
    w = World(bt_spec=spec(**{"strategy": {"type": "Grid", "maxTrials": 4}, **overrides}))
    w.deployments["llm"] = production_target()
    return w


def trial_pods(w: World) -> int:
    return sum(1 for p in w.pods.values() if p["metadata"]["labels"].get("batchtune.io/component") == "trial")


def tick_holding(w: World, held: list[float], advance: float = 5.0) -> None:
    """One tick; `held` gains the device-minutes the world's trial pods held during it."""
    pods = trial_pods(w)
    w.tick(advance=advance)
    held[0] += pods * advance / 60


def run_holding(w: World, held: list[float], limit: int = 400) -> str:
    for _ in range(limit):
        if w.phase in TERMINAL:
            return str(w.phase)
        tick_holding(w, held)
    raise AssertionError(f"phase {w.phase} after {limit} ticks")


def trial_deployments(w: World) -> list[str]:
    return [n for n, d in w.deployments.items() if (d["metadata"].get("labels") or {}).get("batchtune.io/component")
            == "trial"]


# ---- one total over edits, rounds and restarts ----------------------------------------------------------


def test_gpu_minutes_accumulate_across_spec_edits_and_the_ceiling_holds():
    w = world(strategy={"type": "Grid", "maxTrials": 4, "maxGpuMinutes": 2})
    held = [0.0]
    w.run_until({"Trialing"})
    while held[0] < 1.5:
        tick_holding(w, held)
    for generation in (2, 3):  # two edits before the budget is reached: neither resets it
        w.generation = generation
        w.bt_spec["slo"]["headroomPercent"] = 10 + generation
        tick_holding(w, held)
        assert w.status["gpuMinutesCarried"] >= 1.5
    assert run_holding(w, held) in TERMINAL
    assert "GpuBudgetExhausted" in [reason for _, reason, _ in w.events]
    assert held[0] <= 2 + 0.2, f"trials held {held[0]:.2f} GPU-minutes under a budget of 2"
    assert w.status["gpuMinutes"] >= 1


def test_gpu_minutes_are_carried_into_a_new_retune_round():
    w = world(load={"fromProduction": True, "concurrency": 32}, apply={"mode": "Recommend"},
              retune={"intervalSeconds": 600, "checkIntervalSeconds": 60})
    assert w.run_until(TERMINAL) == "Recommended"
    spent = w.status["gpuMinutes"]
    assert spent >= 1
    for _ in range(40):
        w.tick(advance=30)
        if (w.status.get("round") or 1) == 2:
            break
    assert w.status["round"] == 2
    assert w.status["gpuMinutesCarried"] >= spent and w.status["gpuMinutes"] >= spent


def test_a_round_that_starts_with_the_budget_spent_fails_before_planning():
    w = world(load={"fromProduction": True, "concurrency": 32}, apply={"mode": "Recommend"},
              retune={"intervalSeconds": 600, "checkIntervalSeconds": 60})
    assert w.run_until(TERMINAL) == "Recommended"
    spent = w.status["gpuMinutes"]
    w.bt_spec["strategy"]["maxGpuMinutes"] = int(spent)  # the spec is read each tick; no new generation needed
    for _ in range(40):
        w.tick(advance=30)
        if (w.status.get("round") or 1) == 2 and w.phase in TERMINAL:
            break
    assert w.phase == "Failed" and w.condition("Failed")["reason"] == "GpuBudgetExhausted"
    assert not any(t.get("current") for t in w.status.get("trials", [])), "round 2 started a trial past its budget"


# ---- the budget and the deadline while the target is missing ---------------------------------------------------


def test_the_budget_stops_trials_while_the_target_is_missing():
    w = world(strategy={"type": "Grid", "maxTrials": 4, "maxGpuMinutes": 1}, trial={"readinessTimeoutSeconds": 7200})
    w.run_until({"Trialing"})
    w.tick()
    w.tick()
    assert trial_deployments(w)
    production = w.deployments.pop("llm")  # production's Deployment goes (deleted, or being replaced)
    held = [0.0]
    for _ in range(30):
        tick_holding(w, held)
    assert held[0] <= 1 + 0.2, f"trials held {held[0]:.2f} GPU-minutes under a budget of 1 with the target missing"
    assert trial_deployments(w) == []
    assert all(t["state"] in ("Done", "Infeasible", "Failed") for t in w.status["trials"])
    w.deployments["llm"] = production


def test_a_target_missing_past_the_readiness_timeout_fails_the_tuning_and_frees_its_trials():
    w = world(trial={"readinessTimeoutSeconds": 60})
    w.run_until({"Trialing"})
    w.tick()
    w.tick()
    assert trial_deployments(w)
    del w.deployments["llm"]
    w.tick()
    assert w.phase == "Trialing" and w.condition("Progressing")["reason"] == "TargetNotFound"
    assert w.status["targetMissingSince"]
    for _ in range(14):
        w.tick()
    assert w.phase == "Failed" and w.condition("Failed")["reason"] == "TargetNotFound"
    assert "spec.trial.readinessTimeoutSeconds" in w.condition("Failed")["message"]
    assert all(t["state"] == "Failed" for t in w.status["trials"] if t["reason"] == "TargetNotFound")
    w.tick()
    assert trial_deployments(w) == [] and w.jobs == {}


def test_a_target_found_again_clears_the_missing_clock():
    w = world(trial={"readinessTimeoutSeconds": 60})
    production = w.deployments.pop("llm")
    for _ in range(6):
        w.tick()
    assert w.status["targetMissingSince"]
    w.deployments["llm"] = production
    w.tick()
    assert "targetMissingSince" not in w.status and w.phase == "Trialing"


# ---- every accelerator ---------------------------------------------------------------------------------------


def _pod_spec(limits: dict[str, str], **extra) -> dict:
    return {"containers": [{"name": "vllm", "resources": {"limits": limits}}], **extra}


@pytest.mark.parametrize("pod_spec, expected", [
    pytest.param(_pod_spec({"nvidia.com/gpu": "2"}), TrialDevices("nvidia.com/gpu", 2), id="nvidia-gpu"),
    pytest.param(_pod_spec({"nvidia.com/mig-1g.10gb": "1"}), TrialDevices("nvidia.com/mig-1g.10gb", 1), id="mig"),
    pytest.param(_pod_spec({"amd.com/gpu": "4"}), TrialDevices("amd.com/gpu", 4), id="amd"),
    pytest.param(_pod_spec({"cpu": "4"}), TrialDevices("nvidia.com/gpu", 0), id="no-accelerator"),
    pytest.param({"containers": [{"name": "vllm", "resources": {"requests": {"amd.com/gpu": "1"}}},
                                 {"name": "sidecar", "resources": {"limits": {"amd.com/gpu": "1"}}}]},
                 TrialDevices("amd.com/gpu", 2), id="sidecar-counts"),
])
def test_every_accelerator_resource_is_counted(pod_spec, expected):
    assert trial_devices(pod_spec, "spec") == expected


@pytest.mark.parametrize("pod_spec, words", [
    pytest.param(_pod_spec({}, resourceClaims=[{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]),
                 ["spec.resourceClaims[0]", "'gpu'", "DRA"], id="dra-pod-claim"),
    pytest.param({"containers": [{"name": "vllm", "resources": {"claims": [{"name": "gpu"}]}}]},
                 ["spec.containers[0].resources.claims", "'gpu'", "DRA"], id="dra-container-claim"),
    pytest.param(_pod_spec({"nvidia.com/gpu": "1", "amd.com/gpu": "1"}), ["amd.com/gpu", "nvidia.com/gpu"],
                 id="two-kinds"),
])
def test_an_accelerator_batchtune_cannot_count_is_refused_by_name(pod_spec, words):
    refused = trial_devices(pod_spec, "spec")
    assert isinstance(refused, str) and all(w in refused for w in words), refused


def test_free_devices_are_counted_per_resource():
    nodes = [{"metadata": {"name": "a", "labels": {}}, "status": {"allocatable": {"nvidia.com/mig-1g.10gb": "7"}}},
             {"metadata": {"name": "b", "labels": {}}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}]
    pods = [{"spec": {"nodeName": "a", "containers": [{"resources": {"limits": {"nvidia.com/mig-1g.10gb": "3"}}}]},
             "status": {"phase": "Running"}},
            {"spec": {"nodeName": "b", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
             "status": {"phase": "Running"}}]
    eligible = eligible_nodes(nodes, {}, None, "nvidia.com/mig-1g.10gb")
    assert [n["metadata"]["name"] for n in eligible] == ["a"]
    usage, unbound = node_usage(eligible, pods, "nvidia.com/mig-1g.10gb")
    assert [(u.name, u.free) for u in usage] == [("a", 4)] and unbound == []


def _mig_target() -> dict:
    target = production_target()
    target["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": "1"}}
    return target


def test_a_mig_target_waits_for_free_mig_slices_and_its_trials_count_in_the_budget():
    w = World(bt_spec=spec())
    w.deployments["llm"] = _mig_target()
    w.nodes = [{"metadata": {"name": "gpu-node-0", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                "status": {"allocatable": {"nvidia.com/gpu": "8", "nvidia.com/mig-1g.10gb": "0"}}}]
    w.run_until({"Trialing"})
    w.tick()
    assert w.status.get("trials", []) == []
    progressing = w.condition("Progressing")
    assert progressing["reason"] == "WaitingForGPUs" and "nvidia.com/mig-1g.10gb" in progressing["message"]
    w.nodes[0]["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = "7"
    w.tick()
    assert w.status["trials"] and w.status["trials"][0]["gpus"] == 1
    w.now += timedelta(minutes=2)
    w.tick()
    assert w.status["gpuMinutes"] >= 1


def test_a_dra_target_is_refused_naming_the_claim():
    w = World(bt_spec=spec())
    target = production_target()
    target["spec"]["template"]["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
    w.deployments["llm"] = target
    assert w.run_until(TERMINAL) == "Failed"
    failed = w.condition("Failed")
    assert failed["reason"] == "UncountedAccelerator" and "resourceClaims[0]" in failed["message"]
    assert w.created == []
