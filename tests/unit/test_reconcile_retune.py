"""Continuous tuning through the reconcile loop: the watch, drift and schedule, trial 0, the margin, the rounds.

The world starts with short-chat traffic (the knee model: max-num-seqs 32 wins). Then production's
traffic turns to long prompts, where a big batch stalls every sequence's tokens (`long_prompt_model`:
a smaller batch wins), and the watch must notice, run a round that measures production's own setting
as its trial 0, and change or recommend only a setting that beats it by the margin.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from fake_world import (
    World,
    fresh_backoff,  # noqa: F401  # the fixture, used through pytestmark
    knee_model,
    long_prompt_traffic,
)
from fake_world import tuning_world as world

from batchtune.controller.retune import watch_due
from batchtune.core.production import AppliedMark, MarkState
from batchtune.core.retune import judge_round

DECIDED = {"Succeeded", "Recommended", "Failed", "RolledBack"}
pytestmark = pytest.mark.usefixtures("fresh_backoff")


def long_prompt_model(seqs: int, gmu: int, concurrency: int) -> dict[str, float]:
    """Long prompts: each running sequence slows every step, and a bigger batch reserves more for nothing.

    Past 8 running sequences nothing is gained, and every slot reserved costs throughput: the smallest
    batch that holds the load wins (seqs 8: 15 req/s, 16: 14, 32: about 9 within the ITL target).
    """
    figures = knee_model(seqs, gmu, concurrency)
    running = min(seqs, concurrency)
    queue = max(0, concurrency - seqs)
    figures.update({"itlMs": 8.0 + 4.0 * running + 0.6 * seqs, "ttftMs": 200.0 + 300.0 * queue,
                    "requestThroughput": 2.0 * min(running, 8) * (1 - seqs / 128)})
    figures["e2eMs"] = figures["ttftMs"] + 60 * figures["itlMs"]
    return figures


def retuned(mode: str = "Recommend", **retune) -> World:
    retune = retune or {"drift": {"lengthShiftPercent": 30}, "checkIntervalSeconds": 60}
    w = world(load={"fromProduction": True, "concurrency": 32}, apply={"mode": mode}, retune=retune,
              slo={"interTokenLatencyMilliseconds": 60, "ttftMilliseconds": 2000, "headroomPercent": 10})
    return w


def production_args(w: World) -> list[str]:
    return list(w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["args"])


def events(w: World, reason: str) -> list[str]:
    return [m for _, r, m in w.events if r == reason]


def shift_to_long_prompts(w: World) -> None:
    w.traffic = long_prompt_traffic()
    w.model = long_prompt_model


def until_round(w: World, number: int, limit: int = 200) -> None:
    for _ in range(limit):
        if (w.status.get("round") or 1) >= number:
            return
        w.tick()
    raise AssertionError(f"round {number} never started (phase {w.phase}, retune {w.status.get('retune')})")


# ---- the first round, and the watch ------------------------------------------------------------------


def test_the_first_round_is_recorded_and_the_watch_checks_cheaply_without_drift():
    w = retuned()
    assert w.run_until(DECIDED) == "Recommended"
    first, = w.status["rounds"]
    assert (first["round"], first["trigger"], first["outcome"]) == (1, "Initial", "RecommendationReady")
    assert first["endedAt"] and first["bestSetting"] == "seqs=32 gmu=90%"
    assert events(w, "RoundEnded") and "production is watched" in events(w, "RoundEnded")[0]
    queries = w.queries
    w.tick(advance=30)
    assert w.queries == queries  # between checks: no query at all
    for _ in range(30):
        w.tick()
    watch = w.status["retune"]
    assert watch["message"].startswith("within the thresholds") and watch["drift"]["promptShiftPercent"] == 0
    assert w.status["round"] == 1 and w.phase == "Recommended" and w.created.count("Deployment/tune-trial-0") == 1


def test_the_timer_skips_a_watched_tuning_only_between_its_checks():
    # The kopf timer skips a terminal tuning with nothing to clean up; a watched one must still get
    # the tick of each check (the integration test found the watch never ran without this).
    w = retuned()
    w.run_until(DECIDED)
    due = w.status["retune"]["nextCheckAt"]
    assert not watch_due(w.bt_spec, w.status, w.now)
    w.now += timedelta(seconds=61)
    assert watch_due(w.bt_spec, w.status, w.now)
    assert watch_due(w.bt_spec, {**w.status, "retune": {}}, w.now)  # never checked: due now
    assert watch_due(w.bt_spec, {**w.status, "retune": {"nextCheckAt": "garbage"}}, w.now)
    assert watch_due(w.bt_spec, {**w.status, "retune": {"nextCheckAt": due.rstrip("Z")}}, w.now)  # no zone: UTC
    assert not watch_due({k: v for k, v in w.bt_spec.items() if k != "retune"}, w.status, w.now)
    assert not watch_due(w.bt_spec, {**w.status, "phase": "RolledBack"}, w.now)  # the watch stopped
    assert not watch_due(w.bt_spec, {**w.status, "rounds": [{**w.status["rounds"][-1], "endedAt": None}]}, w.now)
    w.tick(advance=0)
    assert w.status["retune"]["lastCheckAt"] and not watch_due(w.bt_spec, w.status, w.now)


def test_a_drift_to_long_prompts_runs_a_round_that_measures_production_and_recommends_another_setting():
    w = retuned()
    w.run_until(DECIDED)
    first = w.status["recommendation"]["setting"]["maxNumSeqs"]
    trials_before = w.status["nextTrialIndex"]
    shift_to_long_prompts(w)
    until_round(w, 2)
    started = events(w, "RoundStarted")
    assert len(started) == 1 and "prompt-length distribution shifted 100%" in started[0]
    assert "spec.retune.drift.lengthShiftPercent" in started[0]
    assert w.run_until(DECIDED) == "Recommended"
    trials = w.status["trials"]
    trial0 = trials[0]
    assert trial0["current"] is True and trial0["index"] == trials_before  # names are never reused
    assert trial0["setting"]["maxNumSeqs"] == 16  # Recommend mode: production still runs its own setting
    # Trial 0 ran production's command line exactly, not a rewrite of it.
    assert w.status["recommendation"]["setting"]["maxNumSeqs"] not in (16, first)
    second = w.status["rounds"][1]
    assert (second["trigger"], second["currentSetting"], second["outcome"]) == ("Drift", "seqs=16 gmu=90%",
                                                                               "RecommendationReady")
    assert second["improvementPercent"] >= 5 and second["bestObjective"] > second["currentObjective"]
    assert "beats production's seqs=16 gmu=90%" in w.status["recommendation"]["reason"]
    assert "prompt mean 2500" in w.status["recommendation"]["workload"]


def test_trial_0_clones_production_as_it_runs():
    w = retuned()
    w.bt_spec["searchSpace"]["extraArgs"] = ["--enforce-eager"]
    w.run_until(DECIDED)
    shift_to_long_prompts(w)
    until_round(w, 2)
    created = []
    for _ in range(40):
        w.tick()
        created = [d for n, d in w.deployments.items() if n.startswith("tune-trial-")]
        if created:
            break
    trial0 = w.deployments[w.status["trials"][0]["name"]]
    container = trial0["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == production_args(w)  # no --enforce-eager, no rewritten knob
    assert "--enforce-eager" not in container["args"]


# ---- Auto mode: a change applied, the margin kept ---------------------------------------------------------


def test_auto_applies_the_new_round_winner_over_production_and_verifies_it():
    w = retuned("Auto")
    assert w.run_until(DECIDED) == "Succeeded"
    round1_args = production_args(w)
    shift_to_long_prompts(w)
    until_round(w, 2)
    assert w.run_until(DECIDED) == "Succeeded"
    assert w.condition("Succeeded")["reason"] == "Verified"
    trial0 = w.status["trials"][0]
    assert trial0["current"] and trial0["setting"]["maxNumSeqs"] == 32  # what round 1 applied, measured again
    assert production_args(w) != round1_args
    mark = AppliedMark.read(w.deployments["llm"])
    assert mark.round == 2 and mark.state is MarkState.VERIFIED and list(mark.previous.args) == round1_args
    assert [r["outcome"] for r in w.status["rounds"]] == ["Verified", "Verified"]


def test_a_candidate_that_does_not_beat_production_by_the_margin_changes_nothing():
    w = retuned("Auto", drift={"lengthShiftPercent": 30}, checkIntervalSeconds=60, minImprovementPercent=500)
    w.run_until(DECIDED)
    round1_args = production_args(w)
    patches = len(w.patches)
    shift_to_long_prompts(w)
    until_round(w, 2)
    assert w.run_until(DECIDED) == "Succeeded"
    assert w.condition("Succeeded")["reason"] == "KeptCurrent"
    assert production_args(w) == round1_args and len(w.patches) == patches
    last = w.status["rounds"][-1]
    assert last["outcome"] == "KeptCurrent" and 0 < last["improvementPercent"] < 500
    assert "below spec.retune.minImprovementPercent 500%" in w.status["recommendation"]["reason"]
    assert w.status["recommendation"]["jsonPatch"] == "[]"  # production as it runs: nothing to apply
    assert "- --max-num-seqs\n        - '32'" in w.status["recommendation"]["kustomizePatch"]
    assert w.status["recommendation"]["args"] == w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0][
        "command"] + round1_args


def test_a_round_whose_best_is_what_production_runs_is_already_optimal():
    w = retuned("Auto", intervalSeconds=3600)
    w.run_until(DECIDED)
    w.now += timedelta(seconds=3600)
    until_round(w, 2)
    assert "spec.retune.intervalSeconds: 3600s have passed" in events(w, "RoundStarted")[0]
    assert w.run_until(DECIDED) == "Succeeded"
    assert w.condition("Succeeded")["reason"] == "AlreadyOptimal"
    # Production ran exactly a candidate's command line, so trial 0 stood in for it: 32 was not run twice.
    assert [t["setting"]["maxNumSeqs"] for t in w.status["trials"]].count(32) == 1


# ---- rounds: bounded, never overlapping, and a stop ------------------------------------------------------


def test_rounds_never_overlap():
    w = retuned()
    w.run_until(DECIDED)
    shift_to_long_prompts(w)
    until_round(w, 2)
    w.traffic = None  # production changes again mid-round: nothing watches until the round decides
    w.now += timedelta(days=1)
    for _ in range(5):
        w.tick()
        assert w.status["round"] == 2 and len(w.status["rounds"]) == 2
    assert len(events(w, "RoundStarted")) == 1


def test_the_round_history_is_bounded():
    w = retuned("Recommend", intervalSeconds=600)
    w.bt_spec["searchSpace"] = {"maxNumSeqs": {"values": [16]}}
    w.bt_spec["strategy"] = {"type": "Grid", "maxTrials": 1}
    for number in range(2, 13):
        w.run_until(DECIDED)
        w.now += timedelta(seconds=600)
        until_round(w, number)
    w.run_until(DECIDED)
    assert w.status["round"] == 12
    assert [r["round"] for r in w.status["rounds"]] == list(range(3, 13))


def test_a_rolled_back_round_stops_the_watch():
    w = retuned("Auto")
    w.run_until(DECIDED)
    shift_to_long_prompts(w)
    until_round(w, 2)

    round1_args = production_args(w)

    def worse(dep, start, end):
        # Round 2's change breaks production; what round 1 applied served it well.
        changed = dep["spec"]["template"]["spec"]["containers"][0]["args"] != round1_args
        itl = 500.0 if changed else 30.0
        return {"itlMs": itl, "ttftMs": 300.0, "e2eMs": 300.0 + 60 * itl, "errorRatePercent": 0.0,
                "servedSharePercent": 100.0, "requests": 1000.0}

    w.production_figures = worse
    assert w.run_until(DECIDED) == "RolledBack"
    ended = events(w, "RoundEnded")[-1]
    assert "retuning stops here" in ended
    w.now += timedelta(days=2)
    for _ in range(5):
        w.tick()
    assert w.status["round"] == 2 and w.phase == "RolledBack" and production_args(w) == round1_args


def test_too_little_production_data_while_watching_is_said_not_a_round():
    w = retuned()
    w.run_until(DECIDED)
    w.traffic = None
    for _ in range(20):
        w.tick()
    assert w.status["round"] == 1
    assert "no drift measured: Deployment inference/llm has no pods to measure" in w.status["retune"]["message"]


def test_prometheus_down_while_watching_degrades_and_the_watch_resumes():
    w = retuned()
    w.run_until(DECIDED)
    w.prometheus_up = False
    for _ in range(20):
        w.tick()
    assert w.condition("Degraded")["reason"] == "PrometheusUnreachable" and w.status["round"] == 1
    w.prometheus_up = True
    shift_to_long_prompts(w)
    until_round(w, 2)


def test_a_new_spec_generation_starts_the_rounds_afresh():
    w = retuned()
    w.run_until(DECIDED)
    w.generation = 2
    w.bt_spec["retune"]["checkIntervalSeconds"] = 120
    w.tick()
    w.tick()
    assert w.status["rounds"][0]["round"] == 1 and len(w.status["rounds"]) == 1 and w.status["round"] == 1


# ---- the margin, pure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("best, current, same, change, reason", [
    pytest.param(12.0, 10.0, False, True, None, id="beats-by-20-percent"),
    pytest.param(10.4, 10.0, False, False, "KeptCurrent", id="four-percent-is-below-the-margin"),
    pytest.param(12.0, None, False, True, None, id="production-missed-the-slo"),
    pytest.param(None, 10.0, False, False, "KeptCurrent", id="no-candidate-met-the-slo"),
    pytest.param(10.0, 10.0, True, False, "AlreadyOptimal", id="production-runs-the-best"),
    pytest.param(9.0, 10.0, False, False, "KeptCurrent", id="worse"),
])
def test_judge_round(best, current, same, change, reason):
    verdict = judge_round("SLO capacity", "seqs=8 gmu=90%" if best is not None else None, best, "seqs=32 gmu=90%",
                          current, same, 5)
    assert verdict.change is change
    assert (verdict.reason.value if verdict.reason else None) == reason
    if reason == "KeptCurrent" and best is not None:
        assert "spec.retune.minImprovementPercent 5%" in verdict.message


# ---- the operator killed mid-round -----------------------------------------------------------------------


def _chaotic_retune(seed: int | None, kills: int = 8) -> tuple[World, int]:
    """Round 1 (Auto), a drift to long prompts, round 2, with the operator killed at random moments."""
    import logging
    import random

    from fake_world import reset_backoff
    from test_reconcile_chaos import KillableCluster, Killed

    from batchtune.controller.reconcile import reconcile

    rng = random.Random(seed) if seed is not None else None
    w = retuned("Auto")
    done = 0
    budget = [rng.randint(1, 12) if rng else -1]
    shifted = False
    for _ in range(2000):
        if w.phase in DECIDED and (w.status.get("round") or 1) == 1 and not shifted:
            shift_to_long_prompts(w)
            shifted = True
        if w.phase in DECIDED and (w.status.get("round") or 1) == 2:
            for _ in range(3):
                w.tick()  # the garbage pass
            return w, done
        ports = w.ports()
        ports.cluster = KillableCluster(w, budget, [])
        try:
            patch = reconcile(w.tuning(), ports, w.now, logging.getLogger("chaos"))
        except Killed:
            done += 1
            reset_backoff()
            budget[0] = rng.randint(1, 12) if rng and done < kills else -1
        else:
            if rng is not None and done < kills and rng.random() < 0.05:
                done += 1  # the status write was lost
                reset_backoff()
            else:
                w.apply(patch)
        w.now += timedelta(seconds=5)
        w.settle()
    raise AssertionError(f"round 2 never decided: {w.phase}, round {w.status.get('round')}")


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in range(10)])
def test_killed_mid_round_it_resumes_to_the_same_decision(seed):
    from collections import Counter

    undisturbed, _ = _chaotic_retune(None)
    w, kills = _chaotic_retune(seed)
    assert kills >= 1
    assert production_args(w) == production_args(undisturbed)
    assert [r["outcome"] for r in w.status["rounds"]] == [r["outcome"] for r in undisturbed.status["rounds"]]
    assert [r["round"] for r in w.status["rounds"]] == [1, 2]
    assert [name for name, n in Counter(w.created).items() if n > 1] == [], "an object was created twice"
    assert w.deployments.keys() == {"llm"} and w.jobs == {}, "an owned object was left behind"
    assert sum(1 for t in w.status["trials"] if t.get("current")) == 1
    mark = AppliedMark.read(w.deployments["llm"])
    assert mark.round == 2 and mark.state is MarkState.VERIFIED


def test_killed_after_a_round_patch_then_a_new_round_restores_the_unverified_change_before_planning():
    """Round 2 patches production and the operator dies before its status write; status is then the decided round 1
    (the patching tick's write lost, status set back as a backup restore or a status writer does) and the watch starts
    round 2 again: planning first restores the change production still carries unverified, from its mark."""
    from test_reconcile_chaos import kill_after_production_patch

    w = retuned("Auto")
    assert w.run_until(DECIDED) == "Succeeded"
    decided = dict(w.status)
    verified = production_args(w)
    shift_to_long_prompts(w)
    until_round(w, 2)
    kill_after_production_patch(w)
    mark = AppliedMark.read(w.deployments["llm"])
    assert mark is not None and mark.round == 2 and mark.state is MarkState.APPLIED and production_args(w) != verified
    w.status = decided
    until_round(w, 2)
    for _ in range(3):
        if w.phase in ("Pending", "Planning"):
            w.tick()
    assert production_args(w) == verified, "the new round planned over round 2's unverified change"
    assert AppliedMark.read(w.deployments["llm"]).state is MarkState.ROLLED_BACK
