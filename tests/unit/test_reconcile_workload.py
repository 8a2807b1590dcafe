"""Production's workload through the reconcile loop: measured, stored, driven, named by the decision."""

from __future__ import annotations

import pytest
from fake_world import (
    World,
    buckets,
    chat_traffic,
    fresh_backoff,  # noqa: F401  # the fixture, used through pytestmark
    production_target,
)
from fake_world import tuning_world as world

from batchtune.core.workload import WorkloadObservation, parse_bucket_text

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
pytestmark = pytest.mark.usefixtures("fresh_backoff")


def load_args(w: World) -> list[str]:
    job = next(iter(w.jobs.values()))
    return list(job["spec"]["template"]["spec"]["containers"][0]["args"])


def test_the_profile_is_stored_and_the_recommendation_names_it():
    w = world(load={"concurrency": 8, "fromProduction": True}, apply={"mode": "Recommend"},
              searchSpace={"maxNumSeqs": {"values": [16, 32]}})
    assert w.run_until(TERMINAL) == "Recommended"
    workload = w.status["workload"]
    assert workload["source"] == "production" and workload["lookbackSeconds"] == 3600
    assert workload["requests"] == 18000 and workload["requestsPerSecond"] == pytest.approx(5.0)
    assert workload["peakRequestsPerSecond"] == pytest.approx(5.0) and workload["rateWindowSeconds"] == 60
    assert workload["promptLengths"]["mean"] == 300 and workload["promptLengths"]["p50"] == pytest.approx(250.0)
    assert len(workload["promptLengths"]["buckets"]) == 13 and "le" not in workload["promptLengths"]["buckets"][-1]
    assert workload["measuredAt"] == "2026-12-01T08:00:00Z"
    assert w.status["recommendation"]["workload"] == workload["summary"]
    assert workload["summary"].startswith("production over 1h (18000 requests)")
    assert "for production over 1h" in w.condition("Succeeded")["message"]


def test_a_tuning_without_production_data_names_the_spec_workload():
    w = world(apply={"mode": "Recommend"}, searchSpace={"maxNumSeqs": {"values": [16]}})
    assert w.run_until(TERMINAL) == "Recommended"
    assert w.status["workload"]["source"] == "spec"
    assert w.status["recommendation"]["workload"] == ("spec.load: 512 prompt and 128 output tokens per request "
                                                      "(fixed), closed loop at 32 concurrent requests")


@pytest.mark.parametrize("traffic, words", [
    pytest.param(None, "has no pods to measure", id="no-pods"),
    pytest.param(WorkloadObservation(3600), "no prompt or output length histogram", id="no-histograms"),
    pytest.param(WorkloadObservation(3600, buckets({}), buckets({})), "served 0 request(s)", id="empty"),
    pytest.param(WorkloadObservation(3600, buckets({100.0: 40}), buckets({50.0: 40})),
                 "served 40 request(s) in the last 1h; a profile needs at least 100", id="sparse"),
])
def test_too_little_production_data_waits_with_a_clear_reason_and_spends_no_gpu(traffic, words):
    w = world(load={"fromProduction": True})
    w.traffic = traffic
    for _ in range(5):
        w.tick()
    assert w.phase == "Planning" and w.created == [] and "workload" not in w.status
    progressing = w.condition("Progressing")
    assert progressing["reason"] == "WaitingForProductionData" and words in progressing["message"]
    assert "spec.load.production.lookbackSeconds 3600" in progressing["message"]
    assert [r for _, r, _ in w.events].count("WaitingForProductionData") == 1  # an Event when it starts, not each tick
    w.traffic = chat_traffic()
    w.run_until({"Trialing"})
    assert w.status["workload"]["source"] == "production"


def test_min_requests_and_lookback_come_from_the_spec():
    w = world(load={"fromProduction": True, "production": {"lookbackSeconds": 7200, "minRequests": 20000}})
    w.tick()
    assert w.condition("Progressing")["reason"] == "WaitingForProductionData"
    assert "in the last 2h; a profile needs at least 20000" in w.condition("Progressing")["message"]


def test_the_load_generator_samples_production_lengths_at_its_peak_with_its_burstiness():
    traffic = chat_traffic()
    counts = [240.0, 360.0] * 30  # bursty: counts swing more than Poisson's
    w = world(load={"fromProduction": True}, searchSpace={"maxNumSeqs": {"values": [16]}},
              objective={"type": "OutputThroughput"})
    w.bt_spec["load"].pop("concurrency")
    w.traffic = WorkloadObservation(3600, traffic.prompt_buckets, traffic.output_buckets, 300.0, 100.0,
                                    tuple(counts), 60)
    w.run_until({"Trialing"})
    while not w.jobs:
        w.tick()
    args = load_args(w)
    assert "--concurrency" not in args
    assert args[args.index("--request-rate") + 1] == "6"  # the peak window: 360 requests a minute
    burstiness = float(args[args.index("--burstiness") + 1])
    assert burstiness == w.status["workload"]["burstiness"] and burstiness < 0.1
    prompts = parse_bucket_text(args[args.index("--prompt-buckets") + 1])
    assert prompts.total == pytest.approx(18000) and prompts.quantile(0.5) == pytest.approx(250.0)
    assert "--output-buckets" in args


def test_an_explicit_load_keeps_the_spec_arrivals_but_production_lengths():
    w = world(load={"concurrency": 8, "fromProduction": True}, searchSpace={"maxNumSeqs": {"values": [16]}})
    w.run_until({"Trialing"})
    while not w.jobs:
        w.tick()
    args = load_args(w)
    assert args[args.index("--concurrency") + 1] == "8" and "--prompt-buckets" in args


def test_the_max_model_len_reaches_the_load_generator():
    w = world(load={"concurrency": 8, "fromProduction": True}, searchSpace={"maxNumSeqs": {"values": [16]}})
    w.deployments["llm"] = production_target(args=["--max-num-seqs", "16", "--max-model-len", "4096"])
    w.run_until({"Trialing"})
    while not w.jobs:
        w.tick()
    args = load_args(w)
    assert args[args.index("--max-model-len") + 1] == "4096"


def test_a_trace_is_mounted_for_the_load_job_and_replayed_faster_to_find_the_capacity():
    w = world(load={"traceConfigMapRef": {"name": "chat-trace", "key": "day.jsonl"}},
              searchSpace={"maxNumSeqs": {"values": [16]}}, apply={"mode": "Recommend"},
              report={"curveLoad": {"type": "Off"}})  # the trace's runs only (the curve step is no replay)
    w.bt_spec["load"].pop("concurrency")
    speeds = []
    for _ in range(200):
        w.tick()
        for job in w.jobs.values():
            args = job["spec"]["template"]["spec"]["containers"][0]["args"]
            speed = int(args[args.index("--trace-speed-percent") + 1])
            if speed not in speeds:
                speeds.append(speed)
            pod = job["spec"]["template"]["spec"]
            assert {"name": "trace", "configMap": {"name": "chat-trace",
                                                   "items": [{"key": "day.jsonl", "path": "trace.jsonl"}]}} \
                in pod["volumes"]
            assert args[args.index("--trace") + 1] == "/trace/trace.jsonl" and "--request-rate" not in args
        if w.phase in TERMINAL:
            break
    assert w.phase == "Recommended"
    assert speeds[0] == 100 and max(speeds) > 100  # as is first, then faster to find where the SLO breaks
    assert w.status["workload"]["source"] == "trace"
    assert w.status["workload"]["summary"] == ("the trace in ConfigMap chat-trace key day.jsonl "
                                               "(spec.load.traceConfigMapRef), replayed as is")
    completed = [m for _, r, m in w.events if r == "TrialCompleted"]
    assert completed and "% of the trace's speed" in completed[0]


def test_goodput_prefers_the_setting_whose_requests_each_meet_the_slo():
    from fake_world import knee_model

    def model(seqs, gmu, load):
        figures = knee_model(seqs, gmu, load)
        # Bigger batches serve more requests, but more of them miss a target on their own (long-prompt tails).
        good_share = {8: 1.0, 16: 0.97, 32: 0.55, 64: 0.5}[seqs]
        figures["goodput"] = figures["requestThroughput"] * good_share
        return figures

    chosen = {}
    for objective in ("SloCapacity", "Goodput"):
        w = world(objective={"type": objective}, apply={"mode": "Recommend"},
                  slo={"interTokenLatencyMilliseconds": 500, "ttftMilliseconds": 60000})
        w.model = model
        assert w.run_until(TERMINAL) == "Recommended"
        chosen[objective] = w.status["recommendation"]["setting"]["maxNumSeqs"]
        args = load_args(w) if w.jobs else None
        assert args is None  # the tuning ended: its Jobs are gone
        if objective == "Goodput":
            trial = next(t for t in w.status["trials"] if t["setting"]["maxNumSeqs"] == chosen[objective])
            assert trial["metrics"]["goodput"] < trial["metrics"]["requestThroughput"]
            assert "goodput" in w.status["recommendation"]["reason"]
    assert chosen == {"SloCapacity": 32, "Goodput": 16}


def test_the_load_generator_counts_goodput_against_the_slo_targets():
    w = world(slo={"interTokenLatencyMilliseconds": 60, "ttftMilliseconds": 2000, "e2eLatencyMilliseconds": 9000},
              searchSpace={"maxNumSeqs": {"values": [16]}})
    w.run_until({"Trialing"})
    while not w.jobs:
        w.tick()
    args = load_args(w)
    i = args.index("--goodput")
    assert args[i + 1:i + 4] == ["ttft:2000", "tpot:60", "e2el:9000"]  # the targets themselves, per request


def _capacity(w: World, seqs: int) -> float:
    return next(t["metrics"]["sloCapacity"] for t in w.status["trials"] if t["setting"]["maxNumSeqs"] == seqs)


def test_the_replica_hint_is_the_observed_peak_over_the_chosen_settings_capacity():
    import math

    w = world(apply={"mode": "Recommend"}, slo={"interTokenLatencyMilliseconds": 40, "ttftMilliseconds": 60000,
                                                "headroomPercent": 10})
    w.production_peak_per_second = 120.0
    assert w.run_until(TERMINAL) == "Recommended"
    rec = w.status["recommendation"]
    chosen = rec["setting"]["maxNumSeqs"]
    capacity = _capacity(w, chosen)
    assert rec["replicasHint"] == math.ceil(120.0 / capacity) == 3
    # It is the chosen setting's capacity: a trial of another capacity would give another number here.
    others = {math.ceil(120.0 / c) for t in w.status["trials"]
              if (c := (t.get("metrics") or {}).get("sloCapacity")) and c != capacity}
    assert others and rec["replicasHint"] not in others
    # And the peak: production's, not the mean (5 req/s here would say 1).
    assert "peak 120 req/s" in rec["replicasBasis"] and "10% headroom" in rec["replicasBasis"]


def test_with_a_profile_the_hint_uses_its_peak_over_all_replicas_and_each_trial_faces_one_replicas_share():
    import math

    w = world(load={"fromProduction": True}, apply={"mode": "Recommend"}, objective={"type": "SloCapacity"},
              searchSpace={"maxNumSeqs": {"values": [16, 32]}})
    w.bt_spec["load"].pop("concurrency")
    w.production_replicas = 3
    w.production_peak_per_second = 999.0  # the 1-minute query is not asked when the profile has a peak
    traffic = chat_traffic(requests_per_window=540.0)  # 9 req/s over 3 replicas
    w.traffic = traffic
    w.run_until({"Trialing"})
    while not w.jobs:
        w.tick()
    args = load_args(w)
    assert args[args.index("--request-rate") + 1] == "3"  # the peak's share of one replica: 9 / 3
    assert w.run_until(TERMINAL) == "Recommended"
    rec = w.status["recommendation"]
    assert w.status["workload"]["replicas"] == 3 and w.status["workload"]["peakRequestsPerSecond"] == 9.0
    assert rec["replicasHint"] == math.ceil(9.0 / _capacity(w, rec["setting"]["maxNumSeqs"]))
    assert "busiest 60s window" in rec["replicasBasis"]


def test_a_fixed_load_objective_gets_no_hint_and_says_why():
    w = world(objective={"type": "OutputThroughput"}, apply={"mode": "Recommend"},
              searchSpace={"maxNumSeqs": {"values": [16]}})
    assert w.run_until(TERMINAL) == "Recommended"
    rec = w.status["recommendation"]
    assert "replicasHint" not in rec
    assert rec["replicasBasis"].startswith("no replica hint: the OutputThroughput objective measures one fixed load")


def test_a_quiet_productions_capacity_search_starts_where_a_window_holds_enough_requests():
    w = world(load={"fromProduction": True}, searchSpace={"maxNumSeqs": {"values": [16]}})
    w.bt_spec["load"].pop("concurrency")
    w.traffic = chat_traffic(requests_per_window=12.0)  # 0.2 req/s: 6 requests in a 30 s window
    w.run_until({"Trialing"})
    while not w.jobs:
        w.tick()
    args = load_args(w)
    # 40 requests (twice the 20 a verdict needs) in spec.trial.measureSeconds 30: 80 a minute.
    assert float(args[args.index("--request-rate") + 1]) * 60 == pytest.approx(80, abs=0.01)
