"""Continuous tuning end to end on the local cluster: production's traffic turns from short chat to long
prompts mid-life, the BatchTuning notices the drift, runs a second round that measures production's
setting as its trial 0, and recommends a different one (Recommend mode: production is never written).

The knob is --max-num-batched-tokens, the token budget of one scheduler step, on the twin's
Llama-3.1-70B fp8 on an H100 (`batchtune twin predict --max-num-batched-tokens 2048|512 --input-len
1950 --output-len 32 --rate 2` gives a P95 ITL of 224 vs 66 ms): with ~50-token chat prompts no step
comes near either budget and both settings serve alike; with ~2000-token prompts a 2048 budget takes a
whole prompt in one ~220 ms step that stalls every running sequence's next token, past the 100 ms ITL
target, while 512 cuts it into ~65 ms chunks. Each round measures one fixed concurrency, so a round
is one load step per trial and the test stays short.
"""

from __future__ import annotations

import json

import pytest
from operator_env import (
    MODEL,
    Traffic,
    batchtuning,
    condition,
    container_of,
    grant_operator_rbac,
    running_operator,
    wait_status,
)
from operator_env import production as production_deployment

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = [MODEL, "--quantization", "fp8", "--max-model-len", "4096", "--max-num-seqs", "32",
        "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.95", "--port", "8000"]
CHAT_WORDS, LONG_WORDS = 40, 1500  # the twin counts 1.3 tokens a word: about 52 and 1950 prompt tokens
DECIDED = {"Succeeded", "Recommended", "Failed", "RolledBack"}


@pytest.fixture
def operator(cluster, kube, namespace, kubectl, batchtuning_crd, tmp_path):
    grant_operator_rbac(kubectl)
    yield from running_operator(cluster.operator_kubeconfig, kube, namespace, tmp_path)


def test_a_drift_to_long_prompts_runs_a_second_round_that_recommends_another_setting(kube, namespace, operator,
                                                                                     prometheus_url, wait_for):
    kube.apps.create_namespaced_deployment(namespace, production_deployment(namespace, args=list(ARGS)))
    wait_for(lambda: (kube.apps.read_namespaced_deployment("llm", namespace).status.ready_replicas or 0) >= 1,
             timeout=90, what="production ready")
    traffic = Traffic(kube, namespace, "app=llm", rate=2, max_tokens=32, concurrency=8, deadline_s=900,
                      prompt_words=CHAT_WORDS)
    traffic.start()
    spec = batchtuning(
        namespace, prometheus_url,
        searchSpace={"maxNumSeqs": {"values": [32]}, "gpuMemoryUtilizationPercent": [95],
                     "maxNumBatchedTokens": [512, 2048]},
        strategy={"type": "Grid", "maxTrials": 2, "maxParallelTrials": 2},
        objective={"type": "OutputThroughput"},
        slo={"percentile": "P95", "interTokenLatencyMilliseconds": 100, "ttftMilliseconds": 20000,
             "maxErrorRatePercent": 1, "headroomPercent": 10},
        load={"fromProduction": True, "concurrency": 8, "production": {"lookbackSeconds": 600, "minRequests": 60}},
        trial={"warmupSeconds": 3, "measureSeconds": 15, "readinessTimeoutSeconds": 90},
        apply={"mode": "Recommend"},
        retune={"drift": {"lengthShiftPercent": 30}, "checkIntervalSeconds": 60, "minImprovementPercent": 5})
    try:
        kube.custom.create_namespaced_custom_object("batchtune.io", "v1alpha1", namespace, "batchtunings", spec)
        # Round 1, on short chat: either budget serves it; whichever is recommended, production is not written.
        bt = wait_status(kube, namespace, "tune", lambda s: s.get("phase") in DECIDED, 240, operator,
                         "round 1 decided")
        status = bt["status"]
        assert status["phase"] == "Recommended", json.dumps(status, indent=1)[-4000:]
        assert status["workload"]["source"] == "production" and status["workload"]["promptLengths"]["p90"] < 100
        assert [(r["round"], r["trigger"], r["outcome"]) for r in status["rounds"]] == [
            (1, "Initial", "RecommendationReady")]
        assert container_of(kube, namespace, "llm")["args"] == ARGS

        # Production's traffic turns to long prompts, a little busier; the watch must notice and start round 2.
        traffic.prompt_words, traffic.rate = LONG_WORDS, 3
        bt = wait_status(kube, namespace, "tune", lambda s: (s.get("round") or 1) >= 2, 240, operator,
                         "in round 2")
        started = bt["status"]["rounds"][-1]
        assert started["trigger"] == "Drift" and "prompt-length distribution shifted" in started["reason"], started
        bt = wait_status(kube, namespace, "tune",
                         lambda s: s.get("phase") in DECIDED and bool(s["rounds"][-1].get("endedAt")), 240,
                         operator, "round 2 decided")
    finally:
        traffic.stop()
    status = bt["status"]
    assert status["phase"] == "Recommended", json.dumps(status, indent=1)[-4000:]
    # The round was tuned for the traffic production serves now (its lookback holds both shapes).
    assert status["workload"]["promptLengths"]["p90"] > 1000, status["workload"]
    # Production's own setting was measured in the round, as its trial 0: its command line as it runs.
    trial0 = next(t for t in status["trials"] if t.get("current"))
    assert trial0["setting"]["maxNumBatchedTokens"] == 2048, trial0
    second = status["rounds"][-1]
    assert second["currentTrial"] == trial0["name"] and "mbt=2048" in second["currentSetting"], second
    # A different setting won: production's missed the SLO under long prompts, or lost by the margin.
    rec = status["recommendation"]
    assert rec["setting"]["maxNumBatchedTokens"] == 512, json.dumps(status["trials"], indent=1)[-3000:]
    assert second["outcome"] == "RecommendationReady", second
    assert second.get("improvementPercent") is None or second["improvementPercent"] >= 5, second
    assert "--max-num-batched-tokens" in rec["args"] and rec["args"][rec["args"].index(
        "--max-num-batched-tokens") + 1] == "512"
    # Recommend mode never writes production.
    assert container_of(kube, namespace, "llm")["args"] == ARGS
    reasons = [e.reason for e in kube.core.list_namespaced_event(namespace).items
               if e.involved_object.name == "tune"]
    assert reasons.count("RoundStarted") == 1 and reasons.count("RoundEnded") == 2, reasons
    assert condition(bt, "Succeeded")["reason"] == "RecommendationReady"
