"""The typed BatchTuning models: helpers, aliases, frozenness, error shape, file loading, status round trips."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from batchtune import api
from batchtune.api import (
    MISSING,
    BatchTuningStatus,
    FieldError,
    InconclusivePolicy,
    InvalidBatchTuning,
    LoadStepRecord,
    MaxNumSeqsSpec,
    Percentile,
    Phase,
    PrunedSetting,
    Reason,
    RunRecord,
    Setting,
    SloSpec,
    StrategyType,
    TrialRecord,
    TrialState,
    load_file,
    parse_batchtuning,
    parse_spec,
    parse_status,
)
from batchtune.api.models import camel
from batchtune.core import Setting as CoreSetting
from batchtune.core import vocabulary
from batchtune.core.vocabulary import LATENCY_METRICS, Verdict

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


def minimal_object() -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / "batchtuning-minimal.yaml").read_text())


@pytest.mark.parametrize("form, expected", [
    pytest.param({"values": [64, 8, 16]}, [8, 16, 64], id="values-sorted"),
    pytest.param({"min": 8, "max": 256}, [8, 16, 32, 64, 128, 256], id="doublings-reach-max"),
    pytest.param({"min": 8, "max": 100}, [8, 16, 32, 64], id="max-not-a-doubling-is-not-tried"),
    pytest.param({"min": 5, "max": 5}, [5], id="min-equals-max"),
    pytest.param({"min": 3, "max": 20}, [3, 6, 12], id="odd-min"),
])
def test_max_num_seqs_candidates(form: dict[str, Any], expected: list[int]) -> None:
    assert MaxNumSeqsSpec.model_validate(form).candidates() == expected


@given(low=st.integers(1, 65536), high=st.integers(1, 65536))
def test_doubling_candidates_start_at_min_double_and_stop_before_passing_max(low: int, high: int) -> None:
    lo, hi = min(low, high), max(low, high)
    got = MaxNumSeqsSpec(min=lo, max=hi).candidates()
    assert got[0] == lo
    assert all(b == 2 * a for a, b in zip(got, got[1:], strict=False))
    assert got[-1] <= hi < got[-1] * 2


def test_search_spec_delegates_candidates() -> None:
    spec = parse_spec(minimal_object()["spec"])
    assert spec.search_space.max_num_seqs_candidates() == [8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("slo, expected", [
    pytest.param({"ttftMilliseconds": 500}, {"ttft_ms": 500}, id="ttft-only"),
    pytest.param({"interTokenLatencyMilliseconds": 50, "e2eLatencyMilliseconds": 9000},
                 {"itl_ms": 50, "e2e_ms": 9000}, id="itl-and-e2e"),
    pytest.param({"ttftMilliseconds": 1, "interTokenLatencyMilliseconds": 2, "e2eLatencyMilliseconds": 3},
                 {"ttft_ms": 1, "itl_ms": 2, "e2e_ms": 3}, id="all-three"),
])
def test_latency_targets_are_keyed_by_trial_metric_attribute(slo: dict[str, int], expected: dict[str, int]) -> None:
    targets = SloSpec.model_validate(slo).latency_targets_ms()
    assert targets == expected
    # Each key is the snake_case form of the status metric key it bounds (ttft_ms -> ttftMs).
    assert all(camel(name) in LATENCY_METRICS for name in targets)


def test_percentile_quantile() -> None:
    assert [p.quantile for p in Percentile] == [0.5, 0.9, 0.95, 0.99]


def test_defaults_follow_the_agreed_field_list() -> None:
    spec = parse_spec(minimal_object()["spec"])
    assert spec.strategy.type is StrategyType.ADAPTIVE
    assert (spec.strategy.max_trials, spec.strategy.max_parallel_trials, spec.strategy.seed) == (12, 1, 0)
    assert spec.search_space.gpu_memory_utilization_percent == [90]
    assert (spec.slo.percentile, spec.slo.max_error_rate_percent, spec.slo.headroom_percent) == (Percentile.P95, 1, 10)
    assert (spec.load.input_tokens, spec.load.output_tokens, spec.load.from_production) == (512, 128, False)
    assert (spec.trial.warmup_seconds, spec.trial.measure_seconds, spec.trial.readiness_timeout_seconds) == (30, 60, 900)
    assert spec.apply.mode is None  # unset means "detect GitOps", not Auto
    assert (spec.apply.verify_seconds, spec.apply.verify_min_requests, spec.apply.verify_timeout_seconds) == (300, 50, 3600)
    assert spec.apply.on_inconclusive_verify is InconclusivePolicy.KEEP
    assert spec.strategy.max_gpu_minutes is None
    assert spec.prometheus.labels.model == "model_name"


def test_snake_case_names_are_accepted_as_well_as_camel_case() -> None:
    by_alias = MaxNumSeqsSpec.model_validate({"values": [8]})
    assert SloSpec(ttft_milliseconds=100).ttft_milliseconds == 100
    assert SloSpec.model_validate({"ttftMilliseconds": 100}).ttft_milliseconds == 100
    assert by_alias.values == [8]


def test_spec_models_are_frozen() -> None:
    spec = parse_spec(minimal_object()["spec"])
    with pytest.raises(ValidationError):
        spec.strategy.max_trials = 99  # type: ignore[misc]


def test_status_models_are_mutable_and_validate_assignment() -> None:
    status = parse_status(full_status())
    status.phase = Phase.SELECTING
    status.trials[0].state = TrialState.FAILED
    assert status.phase is Phase.SELECTING and status.to_wire()["trials"][0]["state"] == "Failed"
    status.phase = "Verifying"  # type: ignore[assignment]
    assert status.phase is Phase.VERIFYING
    with pytest.raises(ValidationError):
        status.phase = "Sleeping"  # type: ignore[assignment]
    with pytest.raises(ValidationError):
        status.trials_planned = -1
    with pytest.raises(ValidationError):
        status.trials[0].gpus = -1
    # Reasons are codes a newer operator may extend; an older one must still read them.
    status.trials[0].reason = "ReasonFromANewerOperator"
    status.trials[0].metrics = {"ttftMs": math.nan, "itlMs": 3.0}
    assert status.trials[0].metrics == {"itlMs": 3.0}


def test_settings_are_frozen_hashable_and_equal_by_value() -> None:
    a = Setting(max_num_seqs=64, gpu_memory_utilization_percent=90)
    b = Setting.model_validate({"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 90})
    assert a == b and len({a, b}) == 1
    with pytest.raises(ValidationError):
        a.max_num_seqs = 8  # type: ignore[misc]
    assert a.summary() == "seqs=64 gmu=90%"
    assert Setting(max_num_seqs=8, gpu_memory_utilization_percent=95, max_num_batched_tokens=4096).summary() == \
        "seqs=8 gmu=95% mbt=4096"


@pytest.mark.parametrize("core", [
    pytest.param(CoreSetting(64, 90), id="two-knobs"),
    pytest.param(CoreSetting(8, 95, 4096), id="three-knobs"),
])
def test_settings_convert_to_and_from_the_core(core: CoreSetting) -> None:
    model = Setting.of(core)
    assert model.core() == core and Setting.of(model.core()) == model
    assert model.to_wire() == core.to_status()


@pytest.mark.parametrize("metrics, expected", [
    pytest.param({"ttftMs": math.nan, "itlMs": 12.5}, {"itlMs": 12.5}, id="nan-dropped"),
    pytest.param({"ttftMs": math.inf, "e2eMs": -math.inf, "itlMs": 1}, {"ttftMs": 1e12, "itlMs": 1.0},
                 id="inf-latency-stays-a-violation"),
    pytest.param({"outputThroughput": math.inf, "itlMs": 1}, {"itlMs": 1.0}, id="inf-other-dropped"),
    pytest.param({"ttftMs": 10, "kvPoolTokens": 3.5}, {"ttftMs": 10.0, "kvPoolTokens": 3.5}, id="any-key-kept"),
    pytest.param({"ttftMs": 10, "queueMs": 3.5, "smOccupancyPercent": 40}, {"ttftMs": 10.0}, id="unkept-dropped"),
    pytest.param({"ttftMs": True, "itlMs": "fast", "e2eMs": None}, {}, id="not-numbers-dropped"),
])
def test_metrics_keep_only_finite_numbers(metrics: dict[str, Any], expected: dict[str, float]) -> None:
    trial = TrialRecord(index=0, name="t", setting=Setting(max_num_seqs=8, gpu_memory_utilization_percent=90), metrics=metrics)
    assert trial.metrics == expected
    assert RunRecord(metrics=metrics).metrics == expected
    assert LoadStepRecord(load=1, metrics=metrics).metrics == expected


def test_step_results_are_run_records() -> None:
    step = LoadStepRecord.model_validate({"load": 4, "results": [{"metrics": {"itlMs": 20.0, "x": math.nan},
                                                                  "crossCheck": "itlMs: apart"}]})
    assert step.results == [RunRecord(metrics={"itlMs": 20.0}, cross_check="itlMs: apart")]
    assert step.to_wire()["results"] == [{"metrics": {"itlMs": 20.0}, "crossCheck": "itlMs: apart"}]


def test_pruned_setting_reason_is_a_code_with_a_message() -> None:
    pruned = PrunedSetting.model_validate({"setting": {"maxNumSeqs": 1024, "gpuMemoryUtilizationPercent": 90},
                                           "reason": "DoesNotFitMemory", "message": "does not fit",
                                           "memoryReason": "KvCacheTooSmall"})
    assert pruned.reason == Reason.DOES_NOT_FIT_MEMORY and pruned.memory_reason == Reason.KV_CACHE_TOO_SMALL
    assert pruned.message == "does not fit"
    with pytest.raises(ValidationError):
        PrunedSetting.model_validate({"setting": {"maxNumSeqs": 8, "gpuMemoryUtilizationPercent": 90},
                                      "reason": "does not fit"})


def test_vocabulary_comes_from_the_core() -> None:
    for name in ("Phase", "TrialState", "Verdict", "ConditionType", "Reason"):
        assert getattr(api, name) is getattr(vocabulary, name)


@pytest.mark.parametrize("edit, path, value", [
    pytest.param({"apiVersion": "batchtune.io/v1"}, "apiVersion", "batchtune.io/v1", id="wrong-version"),
    pytest.param({"kind": "Deployment"}, "kind", "Deployment", id="other-kind"),
    pytest.param({"metadata": {}}, "metadata.name", MISSING, id="no-name"),
])
def test_object_level_errors_name_the_field(edit: dict[str, Any], path: str, value: Any) -> None:
    obj = minimal_object() | edit
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_batchtuning(obj)
    assert [(e.path, e.value) for e in caught.value.errors] == [(path, value)]


def test_all_errors_are_reported_at_once() -> None:
    spec = minimal_object()["spec"] | {"trial": {"repeats": 0, "measureSeconds": 1}, "strategy": {"type": "X"}}
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_spec(spec)
    assert set(caught.value.paths) == {"spec.trial.repeats", "spec.trial.measureSeconds", "spec.strategy.type"}


def _apply(**fields: Any) -> dict[str, Any]:
    return minimal_object()["spec"] | {"apply": fields}


@pytest.mark.parametrize("apply, expected", [
    pytest.param({"verifySeconds": 10}, (10, 3600, InconclusivePolicy.KEEP), id="shortest-window"),
    pytest.param({"verifySeconds": 600, "verifyTimeoutSeconds": 600}, (600, 600, InconclusivePolicy.KEEP), id="timeout-equals-window"),
    pytest.param({"onInconclusiveVerify": "RollBack"}, (300, 3600, InconclusivePolicy.ROLL_BACK), id="roll-back"),
])
def test_apply_verify_fields(apply: dict[str, Any], expected: tuple[int, int, InconclusivePolicy]) -> None:
    spec = parse_spec(_apply(**apply))
    assert (spec.apply.verify_seconds, spec.apply.verify_timeout_seconds, spec.apply.on_inconclusive_verify) == expected


@pytest.mark.parametrize("spec, path", [
    pytest.param(_apply(verifySeconds=9), "spec.apply.verifySeconds", id="verify-seconds-below-10"),
    pytest.param(_apply(verifySeconds=0), "spec.apply.verifySeconds", id="verify-seconds-zero"),
    pytest.param(_apply(verifySeconds=4000), "spec.apply.verifyTimeoutSeconds", id="timeout-shorter-than-window"),
    pytest.param(_apply(verifyMinRequests=0), "spec.apply.verifyMinRequests", id="min-requests-zero"),
    pytest.param(_apply(onInconclusiveVerify="Ignore"), "spec.apply.onInconclusiveVerify", id="unknown-policy"),
    pytest.param(minimal_object()["spec"] | {"strategy": {"maxGpuMinutes": 0}}, "spec.strategy.maxGpuMinutes", id="gpu-minutes-zero"),
    pytest.param(minimal_object()["spec"] | {"load": {"durationSeconds": 60}}, "spec.load.durationSeconds", id="duration-removed"),
])
def test_new_spec_fields_are_validated(spec: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_spec(spec)
    assert caught.value.paths == [path]


def test_max_gpu_minutes() -> None:
    assert parse_spec(minimal_object()["spec"] | {"strategy": {"maxGpuMinutes": 120}}).strategy.max_gpu_minutes == 120


@pytest.mark.parametrize("error, text", [
    pytest.param(FieldError("spec.trial.repeats", 0, "must be at least 1"), "spec.trial.repeats: must be at least 1 (got 0)", id="with-value"),
    pytest.param(FieldError("spec.slo", MISSING, "required field is missing"), "spec.slo: required field is missing", id="missing"),
    pytest.param(FieldError("spec.load.image", "x" * 200, "too long"), "spec.load.image: too long (got \"" + "x" * 76 + "...)", id="long-value-cut"),
])
def test_field_error_text(error: FieldError, text: str) -> None:
    assert str(error) == text


def test_invalid_batchtuning_lists_one_error_per_line() -> None:
    exc = InvalidBatchTuning([FieldError("spec.a", 1, "bad"), FieldError("spec.b", "x", "worse")], source="f.yaml")
    assert str(exc).splitlines() == ["f.yaml: invalid BatchTuning (2 errors)", '  spec.a: bad (got 1)', '  spec.b: worse (got "x")']


def test_load_file_reads_every_document(tmp_path: Path) -> None:
    one = (SAMPLES / "batchtuning-minimal.yaml").read_text()
    path = tmp_path / "two.yaml"
    path.write_text(one + "\n---\n" + one.replace("name: llama-8b\nspec", "name: second\nspec") + "\n---\n")
    assert [bt.metadata.name for bt in load_file(path)] == ["llama-8b", "second"]


def test_load_file_names_another_kind_and_the_document(tmp_path: Path) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text((SAMPLES / "batchtuning-minimal.yaml").read_text()
                    + "\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(InvalidBatchTuning) as caught:
        load_file(path)
    assert caught.value.source == f"{path} (document 2)"
    assert [(e.path, e.value) for e in caught.value.errors] == [("apiVersion", "v1"), ("kind", "ConfigMap")]


def test_load_file_reports_broken_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("spec: [unclosed\n")
    with pytest.raises(InvalidBatchTuning, match="not valid YAML"):
        load_file(path)


def full_status() -> dict[str, Any]:
    setting = {"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 90}
    return {
        "observedGeneration": 3, "phase": "Trialing", "trialsPlanned": 6, "trialsCompleted": 1,
        "conditions": [{"type": "Progressing", "status": "True", "reason": "TrialRunning", "message": "trial 1 of 6",
                        "lastTransitionTime": "2025-01-02T03:04:05Z", "observedGeneration": 3}],
        "baseline": {"maxNumSeqs": 256, "gpuMemoryUtilizationPercent": 90, "args": ["--model", "m"]},
        "pruned": [{"setting": {"maxNumSeqs": 1024, "gpuMemoryUtilizationPercent": 90}, "reason": "DoesNotFitMemory",
                    "message": "does not fit", "memoryReason": "KvCacheTooSmall"}],
        "trials": [{"index": 0, "name": "bt-trial-0", "setting": setting, "state": "Done", "reason": "Measured",
                    "startedAt": "2025-01-02T03:00:00Z", "finishedAt": "2025-01-02T03:04:00Z",
                    "metrics": {"itlMs": 31.5, "outputThroughput": 2400.0}, "verdict": "Met", "verdictReason": "all met",
                    "steps": [{"load": 32, "metrics": {"itlMs": 31.5}, "verdict": "Met", "margin": 0.2}]},
                   {"index": 1, "name": "bt-trial-1", "setting": {**setting, "maxNumSeqs": 128}, "state": "Measuring",
                    "startedAt": "2025-01-02T03:05:00Z"}],
        # A running trial's steps, apart on the wire: every step so far, and the open one's runs and Job.
        "running": [{"index": 1, "steps": [{"load": 32, "metrics": {"itlMs": 40.5}, "verdict": "Met", "margin": 0.1},
                                           {"load": 64}],
                     "open": {"step": 1, "repeat": 1, "job": "bt-load-1-1-1",
                              "results": [{"metrics": {"itlMs": 31.5}, "crossCheck": "itlMs: apart"}]}}],
        "bestTrial": "bt-trial-0", "bestSetting": "seqs=64 gmu=90%",
        "knee": {"maxNumSeqs": 64, "reason": "gain per doubling below 5%"},
        "recommendation": {"setting": setting, "args": ["--max-num-seqs", "64"], "reason": "best", "replicasHint": 2},
        "applied": {"previous": {"args": ["a"]}, "new": {"args": ["b"]}, "appliedAt": "2025-01-02T04:00:00Z",
                    "before": {"itlMs": 30.0}, "after": {"itlMs": 29.0}},
    }


def test_status_round_trips_through_its_wire_form() -> None:
    status = parse_status(full_status())
    assert status.phase is Phase.TRIALING and status.trials[0].state is TrialState.DONE
    assert status.trials[0].started_at == datetime(2025, 1, 2, 3, 0, tzinfo=UTC)
    assert status.condition("Progressing").reason == "TrialRunning"
    assert status.trials[0].reason == Reason.MEASURED and status.pruned[0].reason == Reason.DOES_NOT_FIT_MEMORY
    assert status.trials[1].steps[1].results[0].metrics == {"itlMs": 31.5}
    assert status.trials[1].steps[1].job == "bt-load-1-1-1" and status.trials[1].steps[0].verdict is Verdict.MET
    assert status.applied.previous.args == ["a"] and status.applied.new.args == ["b"]
    assert parse_status(status.to_wire()) == status
    wire = status.to_wire()
    assert "steps" not in wire["trials"][1] and wire["running"][0]["open"]["step"] == 1
    assert wire["running"][0]["open"]["results"] == full_status()["running"][0]["open"]["results"]
    assert status.to_wire()["trials"][0]["startedAt"] == "2025-01-02T03:00:00Z"


def test_status_ignores_fields_it_does_not_know() -> None:
    assert parse_status({"phase": "Pending", "fromAFutureVersion": 1}).phase is Phase.PENDING


def test_empty_status_parses() -> None:
    assert parse_status(None) == BatchTuningStatus()


def test_status_errors_are_named_under_status() -> None:
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_status({"phase": "Sleeping"})
    assert caught.value.paths == ["status.phase"]


@pytest.mark.parametrize("value, ok", [
    pytest.param("fp8_e4m3", True, id="word"), pytest.param("a=b,c:d/e%f~g#h!", True, id="punctuation"),
    pytest.param("fp8 e4m3", False, id="space"), pytest.param("fp8\u00a0e4m3", False, id="nbsp-go-does-not-see-as-space"),
    pytest.param("fp8\u0085", False, id="nel"), pytest.param("fp8\x7f", False, id="del"),
    pytest.param("fp8\x1b[2J", False, id="esc"), pytest.param("f\u00e9", False, id="non-ascii"),
    pytest.param("$(HOME)", False, id="k8s-expansion"),
])
def test_extra_arg_values_are_printable_ascii_on_both_sides(value: str, ok: bool) -> None:
    import re as regex

    obj = minimal_object()
    obj["spec"]["searchSpace"]["extraArgs"] = [f"--kv-cache-dtype={value}"]
    crd = yaml.safe_load((SAMPLES.parents[1] / "crds" / "batchtune.io_batchtunings.yaml").read_text())
    items = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "searchSpace"]["properties"]["extraArgs"]["items"]
    # The API server's pattern (RE2: \s is ASCII there too) must agree with the models'.
    assert bool(regex.fullmatch(items["pattern"].strip("^$"), f"--kv-cache-dtype={value}", regex.ASCII)) is ok
    if ok:
        parse_batchtuning(obj)
    else:
        with pytest.raises(InvalidBatchTuning, match="extraArgs"):
            parse_batchtuning(obj)
