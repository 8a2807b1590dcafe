"""The reconcile loop without a cluster: every phase transition, verify deadlines, rollback, crashes.

Each test drives `controller.reconcile` through the ports against the in-memory world of
`fake_world`: the same code path as the operator, with the clock in the test's hands.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta

import pytest
from fake_world import LOCAL_PROMETHEUS, NS, World, knee_model, production_target, reset_backoff, spec, world

from batchtune.controller.ports import Install
from batchtune.core.production import AppliedMark, MarkState
from batchtune.core.settings import Setting
from batchtune.engines import VLLM

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}


@pytest.fixture(autouse=True)
def _fresh_backoff():
    reset_backoff()
    yield
    reset_backoff()


def production_args(w: World) -> list[str]:
    return list(w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["args"])


def mark(w: World) -> AppliedMark | None:
    return AppliedMark.read(w.deployments["llm"])


def reasons(w: World) -> list[str]:
    return [reason for _, reason, _ in w.events]


# ---- the whole way through ----------------------------------------------------------------------


def test_auto_tunes_applies_exactly_the_chosen_knobs_verifies_and_cleans_up():
    w = world()
    before = production_args(w)
    assert w.run_until(TERMINAL) == "Succeeded"
    assert w.condition("Succeeded")["reason"] == "Verified"
    best = w.status["recommendation"]["setting"]
    expected = VLLM.rewrite(production_target()["spec"]["template"]["spec"]["containers"][0],
                            Setting(best["maxNumSeqs"], best["gpuMemoryUtilizationPercent"]))
    assert production_args(w) == expected["args"] != before
    assert mark(w).state is MarkState.VERIFIED and mark(w).generation == 1
    assert w.deployments.keys() == {"llm"} and w.jobs == {}  # no trial object outlives the tuning
    assert [r for r in reasons(w) if r in ("RecommendationApplied", "Verified")] == ["RecommendationApplied", "Verified"]


def test_recommend_mode_never_touches_production():
    w = world(apply={"mode": "Recommend"})
    before = copy.deepcopy(w.deployments["llm"])
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.deployments["llm"] == before and w.patches == []
    assert w.status["recommendation"]["jsonPatch"]


def test_a_gitops_managed_target_gets_a_recommendation_unless_auto_is_explicit():
    w = world(apply={"mode": None})
    w.bt_spec["apply"].pop("mode")
    w.deployments["llm"]["metadata"]["labels"]["argocd.argoproj.io/instance"] = "prod"
    assert w.run_until(TERMINAL) == "Recommended"
    assert "Argo CD" in w.condition("Succeeded")["message"] and w.patches == []


KSERVE_OWNER = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "name": "llama",
                "uid": "0b1c", "controller": True, "blockOwnerDeletion": True}


@pytest.mark.parametrize("mode", ["Auto", None])
def test_a_target_a_controller_owns_is_never_patched_even_in_auto(mode):
    w = world(apply={"mode": mode})
    if mode is None:
        w.bt_spec["apply"].pop("mode")
    w.deployments["llm"]["metadata"]["ownerReferences"] = [KSERVE_OWNER]
    before = copy.deepcopy(w.deployments["llm"])
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.deployments["llm"] == before and w.patches == []
    succeeded = w.condition("Succeeded")
    assert succeeded["reason"] == "TargetOwned"
    assert "InferenceService llama (serving.kserve.io/v1beta1)" in succeeded["message"]
    assert "spec.predictor.model.args" in succeeded["message"]
    assert ("spec.apply.mode Auto cannot override this" in succeeded["message"]) is (mode == "Auto")
    assert any("Will recommend only" in n for n in w.status["plan"]["notes"])
    assert w.status["recommendation"]["args"] and "TargetOwned" in reasons(w)


def test_an_owner_and_gitops_together_are_named_in_one_condition():
    w = world(apply={"mode": None})
    w.bt_spec["apply"].pop("mode")
    w.deployments["llm"]["metadata"]["ownerReferences"] = [{**KSERVE_OWNER, "kind": "LlamaServer",
                                                            "apiVersion": "example.com/v1", "name": "srv"}]
    w.deployments["llm"]["metadata"]["labels"]["argocd.argoproj.io/instance"] = "prod"
    assert w.run_until(TERMINAL) == "Recommended"
    message = w.condition("Succeeded")["message"]
    assert "controlled by LlamaServer srv (example.com/v1)" in message and "Argo CD manages it" in message
    assert "where the LlamaServer takes them" in message and w.patches == []


def test_a_non_controller_owner_reference_does_not_stop_auto():
    w = world()
    w.deployments["llm"]["metadata"]["ownerReferences"] = [{**KSERVE_OWNER, "controller": False}]
    assert w.run_until(TERMINAL) == "Succeeded" and w.patches


def test_an_owner_that_appears_after_the_selection_stops_the_patch():
    w = world()
    w.run_until({"Applying"})
    w.deployments["llm"]["metadata"]["ownerReferences"] = [KSERVE_OWNER]
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.condition("Succeeded")["reason"] == "TargetOwned" and w.patches == []
    assert w.status.get("applied") is None or not w.status["applied"].get("appliedAt")


def test_extra_args_reach_trials_and_production_alike():
    w = world(searchSpace={"maxNumSeqs": {"values": [16, 32]}, "extraArgs": ["--enable-prefix-caching"]})
    assert w.run_until(TERMINAL) == "Succeeded"
    assert "--enable-prefix-caching" in production_args(w)
    assert "--enable-prefix-caching" in w.status["recommendation"]["args"]


def test_a_numerics_flag_is_not_applied_in_auto_without_the_spec_s_word():
    w = world(searchSpace={"maxNumSeqs": {"values": [16, 32]}, "extraArgs": ["--kv-cache-dtype=fp8"]})
    before = production_args(w)
    assert w.run_until(TERMINAL) == "Recommended"
    assert production_args(w) == before and w.patches == []
    assert w.status["recommendation"]["args"][-2:] == ["--kv-cache-dtype", "fp8"]  # measured; a person applies it
    degraded = w.condition("Degraded")
    assert degraded["reason"] == "AutoDowngraded" and "--kv-cache-dtype" in degraded["message"]
    assert "spec.apply.allowNumericsChange" in degraded["message"]


def test_a_numerics_flag_is_applied_in_auto_when_the_spec_allows_it():
    w = world(searchSpace={"maxNumSeqs": {"values": [16, 32]}, "extraArgs": ["--kv-cache-dtype=fp8"]},
              apply={"mode": "Auto", "allowNumericsChange": True})
    assert w.run_until(TERMINAL) == "Succeeded"
    assert production_args(w)[-2:] == ["--kv-cache-dtype", "fp8"]


@pytest.mark.parametrize("arg", ["--dtype=half", "--seed=7", "--enable-log-requests", "--uvicorn-log-level=debug"])
def test_a_flag_outside_the_default_list_is_refused_unless_the_install_allows_it(arg):
    overrides = {"searchSpace": {"maxNumSeqs": {"values": [16]}, "extraArgs": [arg]}, "apply": {"mode": "Recommend"}}
    w = world(**overrides)
    assert w.run_until(TERMINAL) == "Failed"
    failed = w.condition("Failed")
    assert failed["reason"] == "InvalidSpec" and f"spec.searchSpace.extraArgs[0] '{arg.partition('=')[0]}'" in failed["message"]
    allowing = Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0,
                       extra_flags=(arg.partition("=")[0].removeprefix("--"),))
    w = world(**overrides)
    assert w.run_until(TERMINAL, install=allowing) == "Recommended"
    name, _, value = arg.partition("=")
    assert w.status["recommendation"]["args"][-2 if value else -1:] == ([name, value] if value else [name])


def test_a_switch_given_a_value_fails_before_any_trial_loads_the_model():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}, "extraArgs": ["--enforce-eager=false"]})
    assert w.run_until(TERMINAL) == "Failed"
    assert w.condition("Failed")["reason"] == "InvalidSpec" and "is a switch and takes no value" in \
        w.condition("Failed")["message"]
    assert not [c for c in w.created if c.startswith("Deployment/")]


def test_production_command_line_is_recomputed_at_apply_not_taken_from_status():
    w = world()
    w.run_until({"Applying"})
    w.status["recommendation"]["container"] = {"args": ["--trust-remote-code", "--model", "evil/model"]}
    w.status["recommendation"]["args"] = ["--trust-remote-code"]
    w.run_until(TERMINAL)
    assert "--trust-remote-code" not in production_args(w) and "evil/model" not in production_args(w)


# ---- trials ----------------------------------------------------------------------------------------


def test_a_setting_that_cannot_start_is_infeasible_with_the_engines_reason_and_the_search_goes_on():
    w = world()
    w.trial_failure = lambda seqs, gmu: ("ValueError: No available memory for the cache blocks. Try increasing "
                                         "`gpu_memory_utilization`") if seqs == 64 else None
    assert w.run_until(TERMINAL) == "Succeeded"
    by_seqs = {t["setting"]["maxNumSeqs"]: t for t in w.status["trials"]}
    assert by_seqs[64]["state"] == "Infeasible" and by_seqs[64]["reason"] == "KvCacheTooSmall"
    assert "No available memory for the cache blocks" in by_seqs[64]["message"]
    assert all(by_seqs[s]["state"] == "Done" for s in (8, 16, 32))


def test_a_startup_failure_whose_cause_is_only_in_the_log_is_read_from_the_previous_run_log():
    # Real vLLM prints the cause ~90 lines above its end: the termination message's tail says only this.
    w = world()
    w.trial_failure = lambda seqs, gmu: "RuntimeError: Engine core initialization failed. See root cause above." \
        if seqs == 64 else None
    w.trial_log = lambda seqs, gmu: ("INFO 12-01 [core.py:1] Initializing a V1 LLM engine\n"
                                     "(EngineCore pid=1) ERROR 12-01 [core.py:1510] ValueError: No available memory "
                                     "for the cache blocks. Try increasing `gpu_memory_utilization`\n"
                                     "RuntimeError: Engine core initialization failed. See root cause above.")
    assert w.run_until(TERMINAL) == "Succeeded"
    by_seqs = {t["setting"]["maxNumSeqs"]: t for t in w.status["trials"]}
    assert by_seqs[64]["state"] == "Infeasible" and by_seqs[64]["reason"] == "KvCacheTooSmall"
    assert "No available memory for the cache blocks" in by_seqs[64]["message"]
    assert w.logs_read and all(previous for _, previous in w.logs_read)  # the crashed run, not the restart
    assert {pod for pod, _ in w.logs_read} == {f"{by_seqs[64]['name']}-pod"}  # only the crashed trial's


def test_an_unreadable_log_leaves_the_crash_a_plain_crash_loop():
    w = world()
    w.trial_failure = lambda seqs, gmu: "Engine core initialization failed" if seqs == 64 else None
    assert w.run_until(TERMINAL) == "Succeeded"
    by_seqs = {t["setting"]["maxNumSeqs"]: t for t in w.status["trials"]}
    assert by_seqs[64]["reason"] == "CrashLoopBackOff"  # no cause known: the generic crash, not a memory verdict


def test_trial_objects_outlive_the_outcome_write_never_the_reverse():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    for _ in range(200):
        w.tick()
        done = [t for t in w.status.get("trials", []) if t["state"] == "Done"]
        if done:
            break
    assert done, "the trial never finished"
    # The tick that wrote the outcome kept the objects; the next one deletes them.
    assert done[0]["name"] in w.deployments
    w.tick()
    assert done[0]["name"] not in w.deployments


def test_a_lost_status_write_repeats_safely_in_every_phase():
    clean = world(searchSpace={"maxNumSeqs": {"values": [16, 32]}})
    clean.run_until(TERMINAL)
    w = world(searchSpace={"maxNumSeqs": {"values": [16, 32]}})
    seen = set()
    for _ in range(300):
        phase = w.phase
        status_before = copy.deepcopy(w.status)
        patches = len(w.patches)
        w.tick(advance=0, settle=False)
        # The same tick again, as if its status write had been lost in a crash.
        w.status = status_before
        w.tick(advance=0, settle=False)
        assert len(w.created) == len(set(w.created)), f"phase {phase}: an object was created twice"
        assert len(w.patches) - patches <= 1, f"phase {phase}: production was patched twice"
        seen.add(phase)
        w.now += timedelta(seconds=5)
        w.settle()
        if w.phase in TERMINAL:
            break
    assert {"Trialing", "Selecting", "Applying", "Verifying"} <= seen
    assert (w.phase, w.status["bestSetting"], production_args(w)) == \
        (clean.phase, clean.status["bestSetting"], production_args(clean))


def test_a_second_tick_with_nothing_new_changes_nothing():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    w.auto_ready = False  # the trial pod never comes up: the loop can only wait
    w.run_until({"Trialing"})
    w.tick(advance=0)
    w.tick(advance=0)
    status, created, events = copy.deepcopy(w.status), list(w.created), list(w.events)
    assert w.tick(advance=0, settle=False) == {}
    assert w.status == status and w.created == created and w.events == events


def test_readiness_timeout_fails_the_trial_not_the_setting():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, trial={"readinessTimeoutSeconds": 60})
    w.auto_ready = False
    w.run_until({"Trialing"})
    for _ in range(30):
        w.tick(advance=5)
    trial = w.status["trials"][0]
    assert trial["state"] == "Failed" and trial["reason"] == "ReadinessTimeout"
    assert w.phase == "Failed" and w.condition("Failed")["reason"] == "NoFeasibleSetting"


def test_prometheus_down_past_the_deadline_fails_the_trial_and_frees_its_gpus():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    install = Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0, measurement_deadline_seconds=120)
    w.run_until({"Trialing"}, install=install)
    while not any(j.get("status", {}).get("conditions") for j in w.jobs.values()):
        w.tick(install)  # up to the first load run's end: its figures are what Prometheus must give
    w.prometheus_up = False
    for _ in range(80):
        w.tick(install, advance=10)
        if w.status["trials"][0]["state"] not in ("Deploying", "Measuring", "Warming"):
            break
    trial = w.status["trials"][0]
    assert trial["state"] == "Failed" and trial["reason"] == "MeasurementUnavailable"
    assert w.condition("Degraded")["reason"] == "PrometheusUnreachable"
    w.tick(install)
    assert trial["name"] not in w.deployments


def test_no_free_gpu_waits_instead_of_oversubscribing():
    w = world()
    w.intents = [8]  # another BatchTuning decided a trial that takes the node's eight GPUs
    w.run_until({"Trialing"})
    w.tick()
    assert w.status.get("trials", []) == []
    assert w.condition("Progressing")["reason"] == "WaitingForGPUs"
    w.intents = []
    w.tick()
    assert len(w.status["trials"]) == 1


def test_a_two_gpu_trial_needs_two_gpus_on_one_node():
    w = World(bt_spec=spec())
    w.deployments["llm"] = production_target(gpus=2)
    w.nodes = [{"metadata": {"name": f"n{i}", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
                "status": {"allocatable": {"nvidia.com/gpu": "1"}}} for i in range(4)]
    w.run_until({"Trialing"})
    w.tick()
    assert w.status.get("trials", []) == [] and w.condition("Progressing")["reason"] == "WaitingForGPUs"


def test_the_gpu_budget_stops_the_run_with_the_best_choice_so_far():
    w = world(strategy={"type": "Grid", "maxTrials": 4, "maxGpuMinutes": 2})
    assert w.run_until(TERMINAL) in ("Succeeded", "Failed")
    assert "GpuBudgetExhausted" in reasons(w)
    assert w.status["gpuMinutes"] >= 2
    assert len([t for t in w.status["trials"] if t["state"] == "Done"]) < 4


def test_a_changed_target_during_trials_starts_planning_over():
    w = world()
    w.run_until({"Trialing"})
    for _ in range(5):
        w.tick()
    first = [t["name"] for t in w.status["trials"]]
    w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.33.0"
    w.tick()
    assert w.phase == "Pending" and w.condition("Progressing")["reason"] == "TargetChanged"
    w.run_until({"Trialing"})
    w.tick()
    assert not set(first) & {t["name"] for t in w.status["trials"]}  # trial names are never reused


# ---- production: apply, verify, rollback --------------------------------------------------------------


def degrade_after_change(w: World) -> None:
    original = production_args(w)

    def figures(dep, start, end):
        changed = dep["spec"]["template"]["spec"]["containers"][0]["args"] != original
        itl = 500.0 if changed else 15.0
        return {"itlMs": itl, "ttftMs": 100.0, "e2eMs": 1000.0, "errorRatePercent": 0.0, "servedSharePercent": 100.0,
                "requests": 500.0}
    w.production_figures = figures


def test_a_regression_rolls_back_to_exactly_the_previous_args():
    w = world()
    before = copy.deepcopy(w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0])
    degrade_after_change(w)
    assert w.run_until(TERMINAL) == "RolledBack"
    after = w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]
    assert after == before
    assert w.condition("Failed")["reason"] == "Regression" and mark(w).state is MarkState.ROLLED_BACK


def test_a_rollback_never_overwrites_someone_elses_later_edit():
    w = world()
    degrade_after_change(w)
    w.run_until({"Verifying"})
    container = w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]
    container["args"] = ["--max-num-seqs", "4"]  # a person fixed it by hand meanwhile
    w.deployments["llm"]["metadata"]["resourceVersion"] = w.next_rv()
    assert w.run_until(TERMINAL) == "Failed"
    assert w.condition("Failed")["reason"] == "ProductionChangedByOthers"
    assert container["args"] == ["--max-num-seqs", "4"]


def test_verify_waits_for_traffic_then_keeps_by_default():
    w = world()
    w.production_requests_per_second = 0.0
    w.run_until({"Verifying"})
    for _ in range(20):
        w.tick()
    assert w.phase == "Verifying" and w.condition("Progressing")["reason"] == "WaitingForTraffic"
    assert w.run_until(TERMINAL) == "Succeeded"
    assert w.condition("Succeeded")["reason"] == "KeptUnverified" and mark(w).state is MarkState.KEPT


def test_verify_rolls_back_a_quiet_production_when_told_to():
    w = world(apply={"onInconclusiveVerify": "RollBack"})
    w.production_requests_per_second = 0.0
    before = production_args(w)
    assert w.run_until(TERMINAL) == "RolledBack"
    assert w.condition("Failed")["reason"] == "VerifyInconclusive" and production_args(w) == before


def test_verify_judges_as_soon_as_enough_requests_are_in():
    w = world()
    w.production_requests_per_second = 0.0
    w.run_until({"Verifying"})
    for _ in range(15):
        w.tick()
    w.production_requests_per_second = 5.0
    assert w.run_until(TERMINAL, limit=10) == "Succeeded" and w.condition("Succeeded")["reason"] == "Verified"


def test_a_stuck_rollout_rolls_back():
    w = world(trial={"readinessTimeoutSeconds": 60})
    w.rollout_done = False
    assert w.run_until(TERMINAL) == "RolledBack"
    assert w.condition("Failed")["reason"] == "RolloutStuck"


def test_cooldown_holds_the_change():
    w = world(apply={"cooldownSeconds": 3600})
    w.deployments["llm"]["metadata"]["annotations"]["batchtune.io/applied-at"] = \
        (w.now + timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    w.run_until({"Applying"})
    for _ in range(5):
        w.tick()
    assert w.phase == "Applying" and w.condition("Progressing")["reason"] == "CooldownActive" and w.patches == []


def test_an_apply_conflict_reads_again_and_never_forces():
    w = world()
    w.run_until({"Applying"})
    w.conflict_next_patch = True
    for _ in range(3):
        w.tick()
    assert "ApplyConflict" in json.dumps(w.status["conditions"]) or w.phase == "Verifying"
    assert w.run_until(TERMINAL) == "Succeeded"


def test_a_crash_between_patch_and_status_write_resumes_into_verifying():
    w = world()
    w.run_until({"Applying"})
    while not w.patches:
        saved = copy.deepcopy(w.status)
        w.tick()
    w.status = saved  # the status write of the patching tick was lost
    w.tick()
    assert w.phase == "Verifying" and w.status["applied"]["appliedAt"]
    assert len(w.patches) == 1  # not patched twice
    assert w.run_until(TERMINAL) == "Succeeded"


def test_a_spec_change_restores_unverified_production_and_inherits_nothing():
    w = world()
    original = production_args(w)
    w.run_until({"Verifying"})
    w.tick()
    w.generation = 2
    w.bt_spec["apply"]["mode"] = "Recommend"
    w.tick()
    assert production_args(w) == original and mark(w).state is MarkState.ROLLED_BACK
    assert w.phase == "Pending" and "applied" not in w.status and "recommendation" not in w.status
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.status["observedGeneration"] == 2 and "applied" not in w.status


def test_deleting_the_tuning_mid_verify_restores_production():
    w = world()
    original = production_args(w)
    w.run_until({"Verifying"})
    w.delete()
    assert production_args(w) == original
    assert w.deployments.keys() == {"llm"}


# ---- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, reason, words", [
    pytest.param({"searchSpace": {"maxNumSeqs": {"values": [8]}, "extraArgs": ["--trust-remote-code"]}},
                 "InvalidSpec", "spec.searchSpace.extraArgs[0]", id="code-loading-extra-arg"),
    pytest.param({"searchSpace": {"maxNumSeqs": {"values": [8]}, "extraArgs": ["--max-num-seq=4"]}},
                 "InvalidSpec", "spec.searchSpace.extraArgs[0]", id="tuned-knob-by-prefix"),
    pytest.param({"load": {"image": "evil.example/miner:latest"}}, "NotAllowed", "spec.load.image", id="load-image"),
    pytest.param({"prometheus": {"url": "http://169.254.169.254/latest/meta-data"}}, "NotAllowed",
                 "link-local", id="metadata-url"),
    pytest.param({"prometheus": {"url": "http://127.0.0.1:9090", "authSecretRef": {"name": "db-password"}}},
                 "NotAllowed", "opted in", id="secret-not-opted-in"),
    pytest.param({"slo": {"percentile": "P42"}}, "InvalidSpec", "percentile", id="invalid-spec"),
])
def test_refused_specs_fail_with_a_reason_naming_the_field(overrides, reason, words):
    w = world(**overrides)
    assert w.run_until(TERMINAL) == "Failed"
    failed = w.condition("Failed")
    assert failed["reason"] == reason and words in failed["message"]
    assert w.patches == [] and not [c for c in w.created if c.startswith("Deployment/")]


def test_an_empty_plan_fails_before_any_gpu_is_spent():
    w = world(searchSpace={"maxNumSeqs": {"values": [64]}, "maxNumBatchedTokens": [32]})
    assert w.run_until(TERMINAL) == "Failed" and w.condition("Failed")["reason"] == "EmptySearchSpace"
    assert w.created == []


def test_a_missing_target_waits_and_says_so():
    w = World(bt_spec=spec())
    for _ in range(3):
        w.tick()
    assert w.phase == "Pending" and w.condition("Progressing")["reason"] == "TargetNotFound"
    w.deployments["llm"] = production_target()
    w.tick()
    assert w.phase == "Trialing"


def test_a_long_name_gives_valid_child_names():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    w.name = "a" * 63
    w.run_until({"Selecting", "Applying", "Verifying"} | TERMINAL)
    assert all(len(c.split("/", 1)[1]) <= 63 for c in w.created)


def test_trial_pods_never_match_production_or_its_services():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}})
    w.deployments["llm"] = production_target(labels={"app": "llm", "tier": "gpu"})
    w.deployments["llm"]["spec"]["selector"] = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["llm"]}]}
    w.services = [{"spec": {"selector": {"tier": "gpu"}}}]
    w.run_until({"Trialing"})
    w.tick()
    w.tick()
    trial = w.deployments[w.status["trials"][0]["name"]]
    labels = trial["spec"]["template"]["metadata"]["labels"]
    assert "app" not in labels and "tier" not in labels
    assert trial["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


def test_world_model_has_a_knee():
    # The fixtures above rely on it: more seqs past 32 add no throughput.
    assert knee_model(64, 90, 64)["requestThroughput"] == knee_model(32, 90, 64)["requestThroughput"]
    assert NS == "inference"


def test_production_token_lengths_reach_the_load_generator():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, load={"concurrency": 8, "fromProduction": True,
                                                                   "inputTokens": 512, "outputTokens": 128})
    w.run_until({"Trialing"})
    assert w.status["workload"]["inputTokens"] == 300
    while not w.jobs:
        w.tick()
    args = next(iter(w.jobs.values()))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--input-len") + 1] == "300" and args[args.index("--output-len") + 1] == "100"


def test_a_run_with_too_few_requests_is_run_again_longer_and_then_judged():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, strategy={"type": "Grid", "maxTrials": 1},
              report={"curveLoad": {"type": "Off"}})  # the search's runs only
    w.requests_per_second = 0.5  # 15 requests in the 30 s window: too few for a p95
    assert w.run_until({"Succeeded", "Recommended", "Failed"}) == "Succeeded"
    assert [seconds for _, seconds in w.load_runs] == [30, 50]  # 30 * 20 / 15 with a quarter to spare
    assert len({name for name, _ in w.load_runs}) == 2  # a new Job, never the old one again
    (step,) = w.status["trials"][0]["steps"]
    assert step["measureSeconds"] == 50 and step["lengthened"] == 1
    assert step["verdict"] == "Met" and step["metrics"]["samples"] == 25


def test_the_curve_step_starts_at_the_specs_window_after_the_search_was_lengthened():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, strategy={"type": "Grid", "maxTrials": 1})
    w.requests_per_second = 0.5
    assert w.run_until({"Succeeded", "Recommended", "Failed"}) == "Succeeded"
    assert [seconds for _, seconds in w.load_runs][:3] == [30, 50, 30]
    search, curve = w.status["trials"][0]["steps"]
    assert search["measureSeconds"] == 50 and curve["purpose"] == "Curve" and not curve.get("measureSeconds")


def test_a_run_still_too_thin_at_the_longest_window_is_unknown_and_says_why():
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, strategy={"type": "Grid", "maxTrials": 1},
              objective={"type": "OutputThroughput"}, report={"curveLoad": {"type": "Off"}})  # the search's runs only
    w.requests_per_second = 0.1
    assert w.run_until({"Succeeded", "Recommended", "Failed"}) == "Failed"
    assert [seconds for _, seconds in w.load_runs] == [30, 120]  # capped at 4x spec.trial.measureSeconds
    trial = w.status["trials"][0]
    assert trial["state"] == "Done" and trial["verdict"] == "Unknown"
    assert trial["message"].startswith("only 12 requests behind the percentiles")  # what a rejection quotes


def test_the_capacity_search_keeps_the_window_an_earlier_step_needed():
    # The first load (8) finishes too few requests even at the longest window (14 in 120 s): no verdict, so the
    # search doubles the load, where a window as long finishes enough (28), and the steps after keep that window.
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}}, strategy={"type": "Grid", "maxTrials": 1},
              load={"concurrency": 8}, report={"curveLoad": {"type": "Off"}})  # the search's runs only
    w.requests_per_second_per_load = 0.015
    w.run_until({"Succeeded", "Recommended", "Failed"})
    seconds = [seconds for _, seconds in w.load_runs]
    assert seconds[:2] == [30, 120] and len(seconds) > 2 and set(seconds[2:]) == {120}


@pytest.mark.parametrize("gpu_model, note", [
    pytest.param("NVIDIA H100 80GB HBM3", "memory prefilter: twin model of Llama-3.1-8B on H100-SXM", id="from-dcgm"),
    pytest.param(None, "no dcgm-exporter modelName for its pods): memory prefilter skipped", id="unknown-said-so"),
])
def test_a_namespaced_operator_takes_the_gpu_model_for_the_twin_from_dcgm_never_as_a_node_pin(gpu_model, note):
    w = world()
    w.nodes = None  # a namespaced install cannot read Nodes
    w.gpu_model = gpu_model
    w.run_until({"Trialing"})
    plan = w.status["plan"]
    assert any(note in n for n in plan["notes"]), plan["notes"]
    assert plan.get("gpuProduct") is None
    while not any("-trial-" in name for name in w.deployments):
        w.tick()
    trial = next(d for name, d in w.deployments.items() if "-trial-" in name)
    assert "nvidia.com/gpu.product" not in (trial["spec"]["template"]["spec"].get("nodeSelector") or {})


@pytest.mark.parametrize("objective, best", [
    pytest.param("GpuUtilization", 64, id="gpu-utilization-prefers-the-busiest-gpu"),
    pytest.param("TokensPerJoule", 8, id="tokens-per-joule-prefers-the-frugal-one"),
])
def test_the_objective_decides_which_setting_wins(objective, best):
    def model(seqs, gmu, load):
        figures = knee_model(seqs, gmu, load)
        # Bigger batches keep the GPU busier but draw disproportionately more power.
        figures["smActivePercent"] = min(95.0, 10.0 + seqs)
        figures["powerWatts"] = 100.0 + 20.0 * seqs
        return figures

    w = world(objective={"type": objective}, load={"concurrency": 8},
              slo={"interTokenLatencyMilliseconds": 500, "ttftMilliseconds": 60000}, apply={"mode": "Recommend"})
    w.model = model
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.status["recommendation"]["setting"]["maxNumSeqs"] == best


def test_a_window_prometheus_cannot_resolve_is_refused_up_front():
    from batchtune.controller.ports import Install

    w = world(trial={"measureSeconds": 10})
    assert w.run_until(TERMINAL, install=Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_interval_seconds=15)) == \
        "Failed"
    assert w.condition("Failed")["reason"] == "MeasurementWindowTooShort"
    assert "spec.trial.measureSeconds" in w.condition("Failed")["message"] and w.created == []


@pytest.mark.parametrize("apply, refused", [({"mode": "Auto", "verifySeconds": 20}, True),
                                            ({"mode": "Auto", "verifySeconds": 30}, False),
                                            ({"mode": "Recommend", "verifySeconds": 20}, False)])
def test_a_verify_window_prometheus_cannot_resolve_is_refused_before_any_trial(apply, refused):
    from batchtune.controller.ports import Install

    w = world(trial={"measureSeconds": 60}, apply=apply)
    for _ in range(5):
        w.tick(Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_interval_seconds=15))
    failed = w.condition("Failed")
    if refused:
        assert failed["reason"] == "MeasurementWindowTooShort" and w.created == []
        assert "spec.apply.verifySeconds 20" in failed["message"] and "raise spec.apply.verifySeconds" in failed["message"]
    else:
        assert not failed or failed.get("status") != "True"


def test_extra_args_limits_prune_what_vllm_would_refuse_on_the_trials_command_line():
    # Production runs with chunked prefill; the spec's extra args turn it off and raise the context:
    # vLLM then refuses max_num_batched_tokens < max_model_len, so those settings are never deployed.
    w = world(searchSpace={"maxNumSeqs": {"values": [16]}, "maxNumBatchedTokens": [2048, 8192],
                           "extraArgs": ["--no-enable-chunked-prefill", "--max-model-len=8192"]})
    for _ in range(3):
        w.tick()
    pruned = w.status["pruned"]
    assert [p["setting"]["maxNumBatchedTokens"] for p in pruned] == [2048], pruned
    assert pruned[0]["reason"] == "EngineInvariant" and "max_model_len" in pruned[0]["message"]
    assert w.status["plan"]["engineLimits"]["chunkedPrefill"] is False
    assert w.status["plan"]["engineLimits"]["maxModelLen"] == 8192


# ---- bracketing: short search steps, the capacity measured for the full window ----------------

FAST_SCRAPES = Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0, scrape_interval_seconds=2)


def test_the_search_brackets_with_short_steps_and_measures_its_capacity_for_the_full_window():
    w = world(searchSpace={"maxNumSeqs": {"values": [64]}}, strategy={"type": "Grid", "maxTrials": 1},
              report={"curveLoad": {"type": "Off"}})  # the search's runs only
    assert w.run_until({"Succeeded", "Recommended", "Failed"}, install=FAST_SCRAPES) == "Succeeded"
    seconds = [s for _, s in w.load_runs]
    assert seconds[-1] == 30 and set(seconds[:-1]) == {8} and len(seconds) >= 3  # a quarter of 30, rounded up
    trial = w.status["trials"][0]
    *brackets, last = trial["steps"]
    assert all(s["purpose"] == "Bracket" and s["measureSeconds"] == 8 for s in brackets)
    assert "purpose" not in last and not last.get("measureSeconds") and last["verdict"] == "Met"
    assert last["load"] in [s["load"] for s in brackets if s["verdict"] == "Met"]
    assert trial["metrics"]["sloCapacityLoad"] == last["load"]


def test_bracketing_is_off_when_the_scrape_interval_leaves_too_little_to_save():
    w = world(searchSpace={"maxNumSeqs": {"values": [64]}}, strategy={"type": "Grid", "maxTrials": 1},
              report={"curveLoad": {"type": "Off"}})
    assert w.run_until({"Succeeded", "Recommended", "Failed"}) == "Succeeded"  # 15 s scrapes: 45 s > 30 / 2
    assert {s for _, s in w.load_runs} == {30}
    assert all("purpose" not in s for s in w.status["trials"][0]["steps"])


def test_bracket_seconds_zero_turns_it_off_and_a_window_too_short_for_the_scrapes_fails_planning():
    w = world(searchSpace={"maxNumSeqs": {"values": [64]}}, strategy={"type": "Grid", "maxTrials": 1},
              report={"curveLoad": {"type": "Off"}}, trial={"measureSeconds": 30, "bracketSeconds": 0})
    assert w.run_until({"Succeeded", "Recommended", "Failed"}, install=FAST_SCRAPES) == "Succeeded"
    assert {s for _, s in w.load_runs} == {30}
    w = world(trial={"measureSeconds": 30, "bracketSeconds": 3})
    assert w.run_until({"Succeeded", "Recommended", "Failed"}, install=FAST_SCRAPES) == "Failed"
    message = w.condition("Failed")["message"]
    assert "spec.trial.bracketSeconds 3" in message and w.created == []


# ---- the scrape interval, found out from Prometheus ------------------------------------------------

DISCOVER = Install(operator_image="batchtune:test", prometheus_urls=LOCAL_PROMETHEUS, scrape_lag_seconds=0)  # no override: ask Prometheus


def test_the_scrape_interval_prometheus_reports_sets_bracketing_and_is_recorded_once():
    from batchtune.core.scrape import ScrapeInterval

    w = world(searchSpace={"maxNumSeqs": {"values": [64]}}, strategy={"type": "Grid", "maxTrials": 1},
              report={"curveLoad": {"type": "Off"}})
    w.scrape_interval = ScrapeInterval(2.0, "Prometheus' targets API: job kubernetes-pods scrapes Deployment x's pods")
    assert w.run_until({"Succeeded", "Recommended", "Failed"}, install=DISCOVER) == "Succeeded"
    # 2 s scrapes, as with the override: short bracketing steps, then the full window.
    assert {s for _, s in w.load_runs} == {8, 30}
    assert w.status["plan"]["scrapeInterval"] == {
        "seconds": 2.0, "source": "Prometheus' targets API: job kubernetes-pods scrapes Deployment x's pods"}
    assert w.scrape_lookups == 1  # found at planning; every later tick reads status


def test_a_window_too_short_for_the_interval_found_is_refused_naming_it():
    from batchtune.core.scrape import ScrapeInterval

    w = world(trial={"measureSeconds": 10})
    w.scrape_interval = ScrapeInterval(30.0, "Prometheus' targets API: job slow-pods scrapes Deployment ns/llm's pods")
    assert w.run_until(TERMINAL, install=DISCOVER) == "Failed"
    failed = w.condition("Failed")
    assert failed["reason"] == "MeasurementWindowTooShort" and w.created == []
    assert "spec.trial.measureSeconds 10" in failed["message"]
    assert "(60s at 30s, Prometheus' targets API: job slow-pods" in failed["message"]


def test_the_install_override_wins_over_what_prometheus_reports():
    from batchtune.core.scrape import ScrapeInterval

    w = world(trial={"measureSeconds": 10})
    w.scrape_interval = ScrapeInterval(30.0, "Prometheus' targets API")
    assert w.run_until(TERMINAL, install=FAST_SCRAPES) == "Succeeded"
    assert w.status["plan"]["scrapeInterval"]["source"] == "the install's prometheus.scrapeIntervalSeconds"
    assert w.scrape_lookups == 0


def test_a_prometheus_that_reports_no_interval_is_assumed_at_15_seconds_and_says_so():
    w = world(trial={"measureSeconds": 20})
    w.scrape_interval = None
    assert w.run_until(TERMINAL, install=DISCOVER) == "Failed"
    message = w.condition("Failed")["message"]
    assert "(30s at 15s, assumed: Prometheus reported neither" in message
    assert "set the install's prometheus.scrapeIntervalSeconds" in message
