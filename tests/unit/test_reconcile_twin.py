"""TwinGuided through the reconcile loop: the advice comes from the twin worker (off the reconcile path), sits in
status with the ranking and verdict, guides the next trial and its first load; a twin that misses its
confirmations is distrusted and Adaptive measures instead."""

from __future__ import annotations

import copy
import logging
from functools import lru_cache

import pytest
from fake_world import World, knee_model, production_target, reset_backoff, spec

from batchtune.controller.guidance import TwinWorker
from batchtune.controller.ports import Ports
from batchtune.controller.reconcile import reconcile
from batchtune.core.vocabulary import M
from batchtune.twin.config import ServeConfig
from batchtune.twin.params import TwinParams
from batchtune.twin.predict import Workload, predict

pytestmark = pytest.mark.slow
TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
# The deployment's hidden reality: slower than the catalog's twin, which is all the operator knows.
REALITY = TwinParams(bw_scale=0.88, step_overhead_s=0.0011, seq_overhead_s=18e-6)


def twin_model(seqs: int, gmu: int, concurrency: int) -> dict[str, float]:
    """What the fake Prometheus reports on a closed loop: the twin with hidden parameters (p95 latencies)."""
    return _figures(seqs, gmu, Workload(512, 128, concurrency=concurrency), 30)


def open_model(seqs: int, gmu: int, per_minute: int) -> dict[str, float]:
    """The same on an open loop (the fake load Job passes requests per minute)."""
    return _figures(seqs, gmu, Workload(512, 128, request_rate=per_minute / 60), 60)


@lru_cache(maxsize=256)
def _figures(seqs: int, gmu: int, workload: Workload, window: int) -> dict[str, float]:
    cfg = ServeConfig(model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100", max_num_seqs=seqs,
                      gpu_memory_utilization=gmu / 100)
    concurrency = workload.concurrency or 0
    p = predict(cfg, workload, window, seed=1, params=REALITY)
    return {M.ITL_MS: p["p95_itl_ms"], M.TTFT_MS: p["p95_ttft_ms"], M.E2E_MS: p["p95_e2el_ms"],
            M.ITL_MEAN_MS: p["mean_itl_ms"], M.TTFT_MEAN_MS: p["mean_ttft_ms"],
            M.OUTPUT_THROUGHPUT: p["output_throughput"], M.REQUEST_THROUGHPUT: p["request_throughput"],
            M.RUNNING_REQUESTS: p["mean_running_requests"],
            M.WAITING_REQUESTS: max(0.0, concurrency - p["max_concurrent_requests"]),
            M.KV_CACHE_USAGE_PERCENT: p["kv_cache_usage_pct"], M.PREEMPTIONS_PER_SECOND: p["preemptions_per_s"],
            M.KV_POOL_TOKENS: float(p.memory.kv_cache_tokens) if p.memory else 0.0,
            M.GPU_UTIL_PERCENT: p["gpu_util_pct"], M.POWER_WATTS: p["power_w"]}


@pytest.fixture(autouse=True)
def _fresh_backoff():
    reset_backoff()
    yield
    reset_backoff()


def world(model=twin_model, **overrides) -> World:  # noqa: ANN001
    bt = spec(**{"searchSpace": {"maxNumSeqs": {"values": [8, 16, 32, 64, 128, 256]}},
                 "strategy": {"type": "TwinGuided", "maxTrials": 6},
                 "apply": {"mode": "Recommend"}})
    bt.update({"slo": {"interTokenLatencyMilliseconds": 60, "ttftMilliseconds": 1000, "headroomPercent": 10},
               "load": {"concurrency": 32, "inputTokens": 512, "outputTokens": 128}, **overrides})
    w = World(model=model, bt_spec=bt)
    w.deployments["llm"] = production_target()
    return w


@pytest.mark.timeout(600)  # the twin worker calibrates and ranks in-process: minutes on a loaded 2-core machine
def test_twin_guided_calibrates_and_predicts_the_deployment_it_measured():
    # Open loop: the calibrated twin reproduces the hidden reality and stops after the calibration trial.
    w = world(model=open_model, load={"requestsPerMinute": 600, "inputTokens": 512, "outputTokens": 128},
              slo={"interTokenLatencyMilliseconds": 25, "ttftMilliseconds": 1000, "headroomPercent": 10},
              trial={"warmupSeconds": 10, "measureSeconds": 60, "readinessTimeoutSeconds": 300})
    assert w.run_until(TERMINAL) == "Recommended"
    twin = w.status["twin"]
    assert twin["verdict"] == "Trusted" and twin["mode"] == "confirm", twin
    assert twin["observations"] >= 2 and twin["ranked"] >= 3 and twin["predictions"]
    assert twin["parameters"]["bwScale"] < 1  # the reality streams weights slower than the catalog says
    trials = w.status["trials"]
    assert len(trials) <= 2  # not the 6 allowed
    measured = trials[0]["metrics"]["sloCapacity"]
    calibrated = next(p for p in twin["predictions"] if p["setting"] == trials[0]["setting"])
    assert abs(calibrated["objective"] / measured - 1) < 0.10  # the nominal twin's was 15% off
    assert abs(trials[0]["prediction"]["objective"] / measured - 1) > 0.12


@pytest.mark.timeout(600)  # the twin worker calibrates and ranks in-process: minutes on a loaded 2-core machine
def test_twin_guided_shows_predicted_against_measured_for_every_trial():
    w = world()
    assert w.run_until(TERMINAL) == "Recommended"
    twin = w.status["twin"]
    assert twin["verdict"] in ("Trusted", "Untrusted") and twin["mode"] in ("confirm", "measure"), twin
    trials = w.status["trials"]
    assert twin.get("calibrationSetting") is None  # nothing left to calibrate on: the twin is calibrated
    for trial in trials[: len(trials) if twin["mode"] == "confirm" else 1]:
        prediction = trial["prediction"]
        assert prediction["objective"] > 0 and prediction["capacityLoad"] >= 1
        assert prediction["agrees"] is not None and prediction["comparison"]
        # its capacity search started where the twin predicted the capacity
        assert trial["steps"][0]["load"] == min(prediction["capacityLoad"], 2 * trial["setting"]["maxNumSeqs"])
    assert w.status["recommendation"]["setting"] in [t["setting"] for t in trials]


@pytest.mark.timeout(600)  # the twin worker calibrates and ranks in-process: minutes on a loaded 2-core machine
def test_a_twin_that_misses_its_confirmations_is_distrusted_and_adaptive_measures():
    w = world(model=knee_model)  # the engine behaves like nothing the twin knows
    assert w.run_until(TERMINAL) == "Recommended"
    twin = w.status["twin"]
    assert twin["mode"] == "measure", twin
    assert "TwinDistrusted" in [reason for _, reason, _ in w.events]
    assert len(w.status["trials"]) > 2  # measuring, as Adaptive does


def test_the_advice_is_computed_off_the_reconcile_path_and_read_back_from_status():
    worker = TwinWorker()
    w = world()

    def ports(install=None) -> Ports:  # noqa: ANN001
        base = World.ports(w, install)
        return Ports(base.cluster, base.metrics, base.reports, base.install, base.engines, worker)

    w.ports = ports  # type: ignore[method-assign]
    waited = False
    for _ in range(40):
        w.tick()
        cond = w.condition("Progressing")
        if cond.get("reason") == "TwinSearching":
            waited = True
            assert not w.status.get("trials")  # nothing launched without the advice
            assert worker.drain(120)
        if w.status.get("trials"):
            break
    assert waited and w.status["trials"] and w.status["twin"]["verdict"] == "Nominal"
    # rebuilt from status alone (a restarted operator): the same next step, no second search
    before = copy.deepcopy(w.status)
    again = reconcile(w.tuning(), w.ports(), w.now, logging.getLogger("test"))
    assert again.get("twin", before["twin"]) == before["twin"]


def test_unknown_engine_model_falls_back_to_measuring():
    w = world()
    w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["command"] = [
        "vllm", "serve", "acme/unknown-model"]
    w.tick()
    w.tick()
    for _ in range(6):
        w.tick()
        if w.status.get("twin"):
            break
    twin = w.status["twin"]
    assert twin["available"] is False and twin["verdict"] == "Unavailable", twin
    assert twin["mode"] == "measure" and w.status["trials"]
