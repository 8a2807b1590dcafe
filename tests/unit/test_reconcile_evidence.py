"""Evidence comes only from objects the operator owns, and status is no evidence (issue 22, sections 4 and 10).

A pod anyone may create with the same labels never decides a load result or becomes the load target; a status
writer can neither make the operator patch a setting no trial of this generation measured inside spec.searchSpace
nor crash the reconcile with a field it cannot read; an unset apply mode never changes production.
"""

from __future__ import annotations

import copy
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_world import World, controller_ref, fresh_backoff, world  # noqa: F401  # fresh_backoff: a fixture

from batchtune.api import MAX_TRIAL_INDEX, parse_spec
from batchtune.controller.tick import Tick
from batchtune.core.manifests import LABEL_COMPONENT

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
FORGED_IP = "10.66.66.66"

pytestmark = pytest.mark.usefixtures("fresh_backoff")


def production_args(w: World) -> list[str]:
    return list(w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["args"])


def trial_settings(w: World) -> dict[str, Any]:
    return {t["name"]: (t["state"], t.get("metrics")) for t in w.status.get("trials") or []}


# ---- load pods ---------------------------------------------------------------------------------------------------


class ForgedLoadPods(World):
    """Beside every load Job's own pod, a later pod with the same labels whose termination message claims a
    tiny latency and a huge throughput; `owner` is whom its ownerReference names (None: no reference)."""

    owner: str | None = None

    def load_pod(self, job: dict[str, Any], message: str, end: datetime, exit_code: int = 0) -> None:
        super().load_pod(job, message, end, exit_code)
        name = job["metadata"]["name"]
        claim = json.loads(message) if message.startswith("{") else {}
        claim.update({"p95_itl_ms": 1.0, "p95_ttft_ms": 1.0, "p95_e2el_ms": 2.0, "output_throughput": 1e6,
                      "request_throughput": 1e5})
        forged = copy.deepcopy(self.pods[f"{name}-pod"])
        forged["metadata"]["name"] = f"{name}-forged"
        forged["metadata"]["creationTimestamp"] = "2999-01-01T00:00:00Z"  # newer than the Job's own
        forged["metadata"]["ownerReferences"] = [controller_ref("Job", name, self.owner)] if self.owner else []
        forged["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = json.dumps(claim)
        self.pods[f"{name}-forged"] = forged


@pytest.mark.parametrize("owner", [pytest.param(None, id="no-owner"),
                                   pytest.param("uid-of-another-job", id="same-name-other-uid")])
def test_a_load_pod_the_job_does_not_control_never_decides_a_result(owner):
    honest = world()
    honest.run_until(TERMINAL)
    forged = ForgedLoadPods(bt_spec=copy.deepcopy(honest.bt_spec))
    forged.owner = owner
    forged.deployments["llm"] = copy.deepcopy(world().deployments["llm"])
    forged.run_until(TERMINAL)
    assert forged.status["recommendation"]["setting"] == honest.status["recommendation"]["setting"]
    assert trial_settings(forged) == trial_settings(honest)
    assert all((t.get("metrics") or {}).get("outputThroughput", 0) < 1e5 for t in forged.status["trials"])


# ---- trial pods --------------------------------------------------------------------------------------------------


class ForgedTrialPods(World):
    """Beside every trial pod, a newer ready pod with the same labels at FORGED_IP whose controller is `owner`."""

    owner: str = "none"

    def settle(self) -> None:
        super().settle()
        for name, pod in list(self.pods.items()):
            if pod["metadata"]["labels"].get(LABEL_COMPONENT) != "trial" or name.endswith("-forged"):
                continue
            forged = copy.deepcopy(pod)
            forged["metadata"]["name"] = f"{name}-forged"
            forged["metadata"]["creationTimestamp"] = "2999-01-01T00:00:00Z"
            forged["status"] = {"phase": "Running", "podIP": FORGED_IP,
                                "conditions": [{"type": "Ready", "status": "True"}]}
            refs = {"none": [],
                    # a ReplicaSet of its own, which no trial Deployment controls
                    "own-replicaset": [controller_ref("ReplicaSet", f"{name}-evil-rs", "uid-evil-rs")],
                    # the trial's ReplicaSet by name, with a uid that is not that ReplicaSet's
                    "wrong-uid": [controller_ref("ReplicaSet", pod["metadata"]["ownerReferences"][0]["name"],
                                                 "uid-not-the-replicaset")]}[self.owner]
            if self.owner == "own-replicaset":
                self.replica_sets[f"{name}-evil-rs"] = {"uid": "uid-evil-rs", "controller": "uid-someone-else"}
            forged["metadata"]["ownerReferences"] = refs
            self.pods[f"{name}-forged"] = forged


@pytest.mark.parametrize("owner", ["none", "own-replicaset", "wrong-uid"])
def test_a_trial_pod_the_trial_deployment_does_not_control_is_never_targeted(owner):
    w = ForgedTrialPods(bt_spec=copy.deepcopy(world().bt_spec))
    w.owner = owner
    w.deployments["llm"] = copy.deepcopy(world().deployments["llm"])
    assert w.run_until(TERMINAL) == "Succeeded"
    assert w.load_runs, "load Jobs ran"
    assert all(t.get("podIP") != FORGED_IP for t in w.status["trials"])


def test_the_load_target_is_the_owned_pods_address_not_the_one_status_holds():
    w = world()
    for _ in range(400):
        for trial in w.status.get("trials") or []:
            if trial.get("podIP"):
                trial["podIP"] = FORGED_IP  # a status writer points the trial elsewhere
        for job in w.jobs.values():
            args = " ".join(job["spec"]["template"]["spec"]["containers"][0].get("args") or [])
            assert FORGED_IP not in args, args
        if w.phase in TERMINAL:
            break
        w.tick()
    assert w.load_runs and w.phase == "Succeeded"


# ---- status is not evidence ----------------------------------------------------------------------------------------


def at_applying(**overrides: Any) -> World:
    """A tuning that has just selected (phase Applying), production untouched yet."""
    w = world(**overrides)
    w.run_until({"Applying"})
    assert w.patches == []
    return w


@pytest.mark.parametrize("setting, words", [
    pytest.param({"maxNumSeqs": 65536, "gpuMemoryUtilizationPercent": 90}, "outside spec.searchSpace", id="outside"),
    pytest.param({"maxNumSeqs": 8, "gpuMemoryUtilizationPercent": 95}, "outside spec.searchSpace", id="other-gmu"),
    pytest.param({"maxNumSeqs": 8, "gpuMemoryUtilizationPercent": 90, "maxNumBatchedTokens": 4096},
                 "outside spec.searchSpace", id="batched-tokens-not-searched"),
])
def test_a_forged_recommendation_outside_the_search_space_is_never_applied(setting, words):
    w = at_applying()
    before = production_args(w)
    w.status["recommendation"]["setting"] = setting
    w.run_until(TERMINAL)
    assert w.patches == [] and production_args(w) == before
    failed = w.condition("Failed")
    assert failed["reason"] == "UnmeasuredRecommendation" and words in failed["message"]


def test_a_forged_recommendation_no_trial_measured_is_never_applied():
    w = at_applying()
    before = production_args(w)
    winner = w.status["recommendation"]["setting"]
    for trial in w.status["trials"]:
        if trial["setting"] == winner:
            trial["state"] = "Failed"  # what a status writer can also say: the winner was never measured
    w.run_until(TERMINAL)
    assert w.patches == [] and production_args(w) == before
    failed = w.condition("Failed")
    assert failed["reason"] == "UnmeasuredRecommendation"
    assert "no trial of this generation measured" in failed["message"]


def test_a_forged_recommendation_is_not_written_to_git_either():
    w = at_applying()
    w.status["recommendation"]["setting"] = {"maxNumSeqs": 50000, "gpuMemoryUtilizationPercent": 90}
    tick = Tick(w.tuning(), w.ports(), w.now, logging.getLogger("test"))
    tick.spec = parse_spec(dict(w.bt_spec))
    target = tick.target()
    assert target is not None
    assert tick.args_change(target) is None  # the step PullRequest shares with Auto
    assert tick.status.condition("Failed").reason == "UnmeasuredRecommendation"


def test_the_measured_winner_is_still_applied():
    w = at_applying()
    assert w.run_until(TERMINAL) == "Succeeded" and len(w.patches) >= 1


# ---- forged status fields --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, words", [
    pytest.param("nextTrialIndex", 10 ** 30, "status.nextTrialIndex: must be at most 2147483647", id="huge"),
    pytest.param("nextTrialIndex", 2 ** 63, "status.nextTrialIndex", id="past-int64"),
    pytest.param("nextTrialIndex", -5, "status.nextTrialIndex: must be at least 0", id="negative"),
    pytest.param("nextTrialIndex", "x", "status.nextTrialIndex", id="string"),
    pytest.param("nextTrialIndex", 1.5, "status.nextTrialIndex", id="fraction"),
    pytest.param("nextTrialIndex", {"a": [1]}, "status.nextTrialIndex", id="object"),
    pytest.param("trials", [{"index": 0, "name": "tune-trial-0", "setting": {"maxNumSeqs": 16,
                                                                           "gpuMemoryUtilizationPercent": 101}}],
                 "gpuMemoryUtilizationPercent", id="trial-setting-past-the-crd-bound"),
    pytest.param("trials", [{"index": 2 ** 40, "name": "tune-trial-x", "setting": {"maxNumSeqs": 16,
                                                                                 "gpuMemoryUtilizationPercent": 90}}],
                 "status.trials[0].index", id="trial-index-past-int32"),
    pytest.param("trials", "not a list", "status.trials", id="trials-not-a-list"),
    pytest.param("phase", "Hacked", "status.phase", id="unknown-phase"),
    pytest.param("gpuMinutes", float("nan"), "status.gpuMinutes", id="nan-gpu-minutes"),
])
def test_a_forged_status_field_ends_in_a_clear_condition_not_an_exception(field, value, words):
    w = world()
    w.status = {field: value}
    patch = w.tick()
    degraded = w.condition("Degraded")
    assert degraded["reason"] == "StatusUnreadable" and words in degraded["message"], degraded
    assert any(r == "StatusUnreadable" for _, r, _ in w.events)
    assert field in patch  # the unreadable key is overwritten (or deleted), not left for the next tick
    for _ in range(5):
        w.tick()  # every later tick reads its own status
    assert isinstance(w.status.get("nextTrialIndex", 0), int) and 0 <= w.status.get("nextTrialIndex", 0) <= MAX_TRIAL_INDEX


def test_a_fresh_status_keeps_trial_names_unused():
    w = world()
    w.status = {"nextTrialIndex": "x", "trials": [{"index": 6, "name": "tune-trial-6"}]}
    w.tick()
    for _ in range(5):
        w.tick()
    assert [t["index"] for t in w.status["trials"]][0] == 7


def test_a_counter_at_the_last_index_fails_clearly():
    w = world()
    w.status = {"nextTrialIndex": MAX_TRIAL_INDEX}
    w.run_until(TERMINAL)
    failed = w.condition("Failed")
    assert failed["reason"] == "StatusUnreadable" and "status.nextTrialIndex" in failed["message"]
    assert w.created == []


# ---- an unset mode is Recommend --------------------------------------------------------------------------------------


def test_an_unset_mode_recommends_and_never_touches_production():
    w = world()
    del w.bt_spec["apply"]["mode"]
    before = production_args(w)
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.patches == [] and production_args(w) == before
    assert w.status["mode"] == "Recommend"


@pytest.mark.parametrize("mode", ["Auto", "Recommend"])
def test_status_shows_the_mode_in_effect_from_planning_on(mode):
    w = world(apply={"mode": mode})
    for _ in range(3):
        w.tick()
    assert w.status["mode"] == mode


def test_the_printer_columns_show_the_mode():
    crd = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "crds" / "batchtune.io_batchtunings.yaml").read_text().split("---\n", 1)[1])
    version = crd["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Mode"] == ".status.mode"
    assert version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["mode"]["enum"] == [
        "Auto", "Recommend", "PullRequest"]

