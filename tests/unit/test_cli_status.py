"""`batchtune status`: rendering of canned BatchTunings, --watch's ending, and its error paths."""

from __future__ import annotations

import io
from datetime import UTC, datetime

import cli_fakes
import pytest
from rich.console import Console

from batchtune.cli import main
from batchtune.cli import status as st
from batchtune.client import ApiUnreachable

NOW = datetime(2025, 1, 1, 11, 0, tzinfo=UTC)


def text_of(renderable, width: int = 220) -> str:
    console = Console(width=width, color_system=None)
    with console.capture() as captured:
        console.print(renderable)
    return captured.get()


@pytest.mark.parametrize("value, digits, expected", [
    pytest.param(None, 0, "-", id="missing"),
    pytest.param(float("nan"), 1, "-", id="nan-is-not-a-number"),
    pytest.param(True, 0, "-", id="bool"),
    pytest.param(1234.5678, 0, "1,235", id="thousands"),
    pytest.param(41.26, 1, "41.3", id="one-digit"),
    pytest.param("12", 0, "12", id="numeric-string"),
    pytest.param("n/a", 0, "n/a", id="text-kept"),
])
def test_fmt(value, digits, expected):
    assert st.fmt(value, digits) == expected


@pytest.mark.parametrize("timestamp, expected", [
    pytest.param("2025-01-01T10:59:30Z", "30s", id="seconds"),
    pytest.param("2025-01-01T10:30:00Z", "30m", id="minutes"),
    pytest.param("2025-01-01T06:15:00Z", "4h45m", id="hours"),
    pytest.param("2024-12-20T11:00:00Z", "12d", id="days"),
    pytest.param("2025-01-01T11:05:00Z", "0s", id="future-clock-skew"),
    pytest.param(None, "-", id="missing"),
    pytest.param("yesterday", "yesterday", id="unparsable-kept"),
])
def test_age(timestamp, expected):
    assert st.age(timestamp, NOW) == expected


@pytest.mark.parametrize("setting, expected", [
    pytest.param({"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 90},
                 "max-num-seqs 64, gpu-memory-utilization 90%", id="two-knobs"),
    pytest.param({"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 90, "maxNumBatchedTokens": 8192},
                 "max-num-seqs 64, gpu-memory-utilization 90%, max-num-batched-tokens 8192", id="three-knobs"),
    pytest.param(None, "-", id="none"),
])
def test_setting_label(setting, expected):
    assert st.setting_label(setting) == expected


def test_succeeded_tuning_shows_trials_best_knee_decision_and_production():
    out = text_of(st.render_status(cli_fakes.succeeded(), NOW))
    assert "inference/llama-8b" in out and "Succeeded (Verified)" in out
    assert "6/6 done" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│")
            and line.split("│")[1].strip().isdigit()}
    assert set(rows) == {"0", "1", "2", "3", "4", "5"}
    assert "★ best" in rows["3"] and "◆ knee" in rows["3"]
    assert "★" not in rows["2"] + rows["4"]
    assert "2,810" in rows["3"] and "41.3" in rows["3"] and "95" in rows["3"]
    assert "Violated" in rows["4"] and "77.5" in rows["4"]
    # A trial that never served shows dashes, never zeros, and says why under the table.
    assert "Infeasible" in rows["5"] and " 0 " not in rows["5"]
    assert "  #5 KvCacheTooSmall: ValueError: No available memory for the cache blocks." in out
    assert "  #4 p95 ITL 77.5 ms > 50 ms" in out
    assert "ITL p95 ms" in out  # the column names the SLO's percentile
    assert "Decision: max-num-seqs 128, gpu-memory-utilization 90%" in out
    assert "why: highest output throughput" in out
    assert "knee: max-num-seqs 128" in out
    assert "replicas: 2" in out
    assert "verified at 2025-01-01T10:40:00Z" in out
    assert "pruned before any GPU was used: 1 setting(s)" in out


def test_percentile_follows_the_spec():
    bt = cli_fakes.succeeded()
    bt["spec"]["slo"]["percentile"] = "P99"
    out = text_of(st.trials_table(bt))
    assert "ITL p99 ms" in out and "p95" not in out.split("\n")[2]


def test_trialing_tuning_shows_progress_and_no_decision():
    out = text_of(st.render_status(cli_fakes.trialing(), NOW))
    assert "Trialing (Planned)" in out
    assert "2/6 done, 1 running" in out
    assert "Measuring" in out
    assert "Decision" not in out and "best " not in out
    assert "#2 " not in out  # a measuring trial has nothing to explain yet


def test_failed_tuning_says_why_there_is_no_decision():
    out = text_of(st.render_status(cli_fakes.failed(), NOW))
    assert "No decision: NoFeasibleSetting: no trial met p95 ITL 50 ms" in out
    assert "Failed (NoFeasibleSetting)" in out


def test_new_tuning_without_status_points_at_the_operator():
    out = text_of(st.render_status(cli_fakes.fresh(), NOW))
    assert "phase Pending" in out
    assert "(no trial yet)" in out
    assert "operator has not picked this BatchTuning up" in out
    assert "Conditions" not in out


def test_recommended_tuning_says_production_is_untouched_and_how_to_apply():
    bt = cli_fakes.succeeded()
    bt["status"]["phase"] = "Recommended"
    bt["status"].pop("applied")
    out = text_of(st.decision(bt))
    assert "not changed (Recommend mode); apply with `batchtune recommend llama-8b -o patch`" in out


def test_piped_output_is_wide_enough_for_the_table(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False, raising=False)
    assert st.console().width == 160


def test_batched_tokens_and_capacity_columns_appear_only_when_used():
    bt = cli_fakes.succeeded()
    assert "batched tok" not in text_of(st.trials_table(bt))
    assert "capacity" not in text_of(st.trials_table(bt))
    bt["status"]["trials"][0]["setting"]["maxNumBatchedTokens"] = 8192
    bt["status"]["trials"][0]["metrics"]["sloCapacity"] = 3.5
    out = text_of(st.trials_table(bt))
    assert "batched tok" in out and "8192" in out
    assert "capacity" in out and "3.5" in out


@pytest.mark.parametrize("final, code", [
    pytest.param(cli_fakes.succeeded, 0, id="succeeded"),
    pytest.param(cli_fakes.failed, 1, id="failed"),
])
def test_watch_refreshes_until_terminal_and_rides_out_an_outage(final, code, monkeypatch):
    monkeypatch.setattr(st, "console", lambda: Console(file=io.StringIO(), width=200))
    sequence = [cli_fakes.trialing(), ApiUnreachable("connection refused"), final()]
    calls = []

    def fetch():
        calls.append(1)
        item = sequence.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    assert st.watch(fetch, cli_fakes.trialing(), interval=0) == code
    assert len(calls) == 3 and not sequence


def test_watch_on_a_terminal_tuning_returns_at_once(monkeypatch):
    monkeypatch.setattr(st, "console", lambda: Console(file=io.StringIO(), width=200))

    def fetch():
        raise AssertionError("fetched a finished tuning")

    assert st.watch(fetch, cli_fakes.succeeded(), interval=0) == 0


# ---- end to end over a fake API server ---------------------------------------------------

@pytest.fixture
def api():
    fake = cli_fakes.FakeApi()
    yield fake
    fake.close()


def test_status_command_prints_the_table(api, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace="inference")
    assert main(["status", "llama-8b", "--kubeconfig", str(kubeconfig)]) == 0
    out = capsys.readouterr().out
    assert "★ best" in out and "Decision: max-num-seqs 128" in out


def test_status_uses_the_namespace_flag_over_the_context(api, tmp_path, capsys):
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace="elsewhere")
    assert main(["status", "llama-8b", "-n", "inference", "--kubeconfig", str(kubeconfig)]) == 0
    assert api.requests[-1].endswith("/namespaces/inference/batchtunings/llama-8b")


@pytest.mark.parametrize("setup, name, message", [
    pytest.param(lambda api: None, "llama-8b",
                 "the BatchTuning CRD (batchtunings.batchtune.io) is not installed", id="no-crd"),
    pytest.param(lambda api: api.add_empty_list("inference"), "llama-8b",
                 'BatchTuning "llama-8b" not found in namespace "inference"; there are no BatchTunings', id="none"),
    pytest.param(lambda api: api.add_batchtuning(cli_fakes.succeeded()), "llama-70b",
                 'BatchTuning "llama-70b" not found in namespace "inference"; BatchTunings in inference: llama-8b',
                 id="unknown-name-lists-the-known"),
    pytest.param(lambda api: api.routes.update({
        "/apis/batchtune.io/v1alpha1/namespaces/inference/batchtunings/llama-8b":
            cli_fakes.forbidden('batchtunings.batchtune.io "llama-8b" is forbidden: User "bob" cannot get')}),
                 "llama-8b", "forbidden: your identity may not get BatchTuning inference/llama-8b", id="rbac"),
])
def test_status_error_paths(api, tmp_path, capsys, setup, name, message):
    setup(api)
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace="inference")
    assert main(["status", name, "--kubeconfig", str(kubeconfig)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_status_without_a_kubeconfig(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["status", "llama-8b"]) == 1
    err = capsys.readouterr().err
    assert f"no kubeconfig at {tmp_path}/.kube/config" in err


def _production_workload() -> dict:
    return {"source": "production", "summary": "production over 1h (18000 requests): 5 req/s mean",
            "measuredAt": "2025-01-01T10:55:00Z", "lookbackSeconds": 3600, "requests": 18000,
            "requestsPerSecond": 5.0, "peakRequestsPerSecond": 7.5, "burstiness": 0.6, "rateWindowSeconds": 60,
            "prefixCacheHitPercent": 31.0,
            "promptLengths": {"mean": 300.0, "p50": 250.0, "p90": 440.0, "p99": 494.0, "buckets": []},
            "outputLengths": {"mean": 100.0, "p50": 90.0, "p90": 180.0, "p99": 198.0, "buckets": []},
            "notes": ["some lengths lie above the histogram's last finite bound"]}


def test_the_measured_workload_is_shown_and_the_decision_names_it():
    bt = cli_fakes.succeeded()
    bt["status"]["workload"] = _production_workload()
    bt["status"]["recommendation"]["workload"] = bt["status"]["workload"]["summary"]
    out = text_of(st.render_status(bt, NOW))
    assert "Workload: production over 3,600s, 18,000 requests, measured 5m ago" in out
    assert "arrivals: 5.00 req/s mean, 7.50 peak (60s windows), burstiness 0.60 (burstier than Poisson)" in out
    assert "prompt tokens: mean 300  p50 250  p90 440  p99 494" in out
    assert "prefix cache: 31% of prompt tokens hit" in out
    assert "note: some lengths lie above" in out
    assert "for: production over 1h (18000 requests): 5 req/s mean" in out


def test_unmeasured_burstiness_says_poisson_is_assumed():
    bt = cli_fakes.succeeded()
    bt["status"]["workload"] = {**_production_workload(), "burstiness": None}
    assert "burstiness not measured (Poisson assumed)" in text_of(st.workload_block(bt, NOW))


def test_a_spec_workload_is_one_line():
    bt = cli_fakes.succeeded()
    bt["status"]["workload"] = {"source": "spec", "summary": "spec.load: 512 prompt and 128 output tokens"}
    assert text_of(st.workload_block(bt, NOW)).strip() == "Workload: spec.load: 512 prompt and 128 output tokens"


def test_goodput_gets_a_column_when_measured():
    bt = cli_fakes.succeeded()
    assert "goodput" not in text_of(st.trials_table(bt))
    bt["status"]["trials"][3]["metrics"]["goodput"] = 2.75
    out = text_of(st.trials_table(bt))
    assert "goodput" in out and "2.75" in out


def test_rounds_and_the_watch_are_shown():
    bt = cli_fakes.succeeded()
    bt["status"]["trials"][0]["current"] = True
    bt["status"]["rounds"] = [
        {"round": 1, "trigger": "Initial", "startedAt": "2025-01-01T09:00:00Z", "endedAt": "2025-01-01T09:30:00Z",
         "bestSetting": "seqs=128 gmu=90%", "outcome": "Verified"},
        {"round": 2, "trigger": "Drift", "reason": "the prompt-length distribution shifted 63%",
         "startedAt": "2025-01-01T10:00:00Z", "endedAt": "2025-01-01T10:40:00Z", "currentTrial": "t-6",
         "currentSetting": "seqs=128 gmu=90%", "currentObjective": 3.1, "bestSetting": "seqs=32 gmu=90%",
         "bestObjective": 3.9, "improvementPercent": 25.8, "outcome": "Verified"}]
    bt["status"]["retune"] = {"lastCheckAt": "2025-01-01T10:59:00Z", "nextCheckAt": "2025-01-01T11:04:00Z",
                              "message": "within the thresholds: prompt lengths moved 4%"}
    out = text_of(st.render_status(bt, NOW))
    assert "Rounds (spec.retune)" in out and "● production" in out
    row = next(line for line in out.splitlines() if "Drift" in line)
    assert "seqs=128 gmu=90% (3.10)" in row and "seqs=32 gmu=90% (3.90)" in row and "25.8" in row
    assert "round 2 started: the prompt-length distribution shifted 63%" in out
    assert "watching: next check at 2025-01-01T11:04:00Z; last check 60s ago: within the thresholds" in out


def test_twin_guided_tuning_shows_predicted_against_measured_per_trial():
    bt = cli_fakes.succeeded()
    bt["spec"]["objective"] = {"type": "OutputThroughput"}
    trials = bt["status"]["trials"]
    trials[0]["prediction"] = {"objective": 700.0, "capacityLoad": 16, "agrees": False,
                               "comparison": "outputThroughput: predicted 700, measured 610 (+15%, tolerance 10%)"}
    trials[2]["prediction"] = {"objective": 1900.0, "capacityLoad": 64, "agrees": True, "comparison": "itlMs ..."}
    trials[2]["steps"] = [{"load": 64}]
    bt["status"]["twin"] = {"basis": "b", "verdict": "Trusted", "mode": "confirm", "observations": 7, "ranked": 12,
                            "searchSeconds": 2.4, "parameters": {"bwScale": 0.91},
                            "predictions": [{"setting": trials[2]["setting"], "objective": 1975.0}]}
    out = text_of(st.render_status(bt, NOW))
    assert "Twin Trusted" in out and "calibrated on 7 load step(s)" in out and "12 candidates ranked in 2.4 s" in out
    assert "bwScale 0.91" in out and "Predicted against measured" in out
    table = out.split("Predicted against measured")[1].split("Decision")[0]
    rows = {seqs: next((line for line in table.splitlines() if f"max-num-seqs {seqs}," in line), "")
            for seqs in (16, 32, 64)}
    assert "700.00" in rows[16] and "610.40" in rows[16] and " no " in rows[16], rows
    assert all(f in rows[64] for f in ("1,900.00", "1,980.70", "1,975.00", " 64 ", " yes ")), rows
    assert rows[32] == ""  # launched on no prediction: not in the table
    del bt["status"]["twin"]
    assert "Predicted against measured" not in text_of(st.render_status(bt, NOW))


def test_an_untrusted_twin_that_does_not_steer_says_so():
    bt = cli_fakes.succeeded()
    bt["status"]["twin"] = {"basis": "b", "verdict": "Untrusted", "mode": "measure", "observations": 3, "ranked": 4,
                            "reason": "3 of 9 residuals outside their tolerance; worst: median_ttft_ms ..."}
    out = text_of(st.render_status(bt, NOW))
    assert "Twin Untrusted" in out and "next trial: measure" in out
    assert "the twin does not steer, trials are chosen by measuring" in " ".join(out.split())
    assert "3 of 9 residuals outside their tolerance" in out
