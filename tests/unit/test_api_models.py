"""The typed BatchTuning models: helpers, aliases, frozenness, error shape, file loading, status round trips."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from batchtune.api import (
    MISSING,
    BatchTuningStatus,
    FieldError,
    InvalidBatchTuning,
    MaxNumSeqsSpec,
    Percentile,
    Phase,
    Setting,
    SloSpec,
    StrategyType,
    TrialMetrics,
    TrialState,
    load_file,
    parse_batchtuning,
    parse_spec,
    parse_status,
)

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
    assert all(b == 2 * a for a, b in zip(got, got[1:]))
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
    assert all(name in TrialMetrics.model_fields for name in targets)


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
    assert spec.prometheus.labels.model == "model_name"


def test_snake_case_names_are_accepted_as_well_as_camel_case() -> None:
    by_alias = MaxNumSeqsSpec.model_validate({"values": [8]})
    assert SloSpec(ttft_milliseconds=100).ttft_milliseconds == 100
    assert SloSpec.model_validate({"ttftMilliseconds": 100}).ttft_milliseconds == 100
    assert by_alias.values == [8]


def test_models_are_frozen() -> None:
    spec = parse_spec(minimal_object()["spec"])
    with pytest.raises(ValidationError):
        spec.strategy.max_trials = 99  # type: ignore[misc]


def test_settings_are_hashable_and_equal_by_value() -> None:
    a = Setting(max_num_seqs=64, gpu_memory_utilization_percent=90)
    b = Setting.model_validate({"maxNumSeqs": 64, "gpuMemoryUtilizationPercent": 90})
    assert a == b and len({a, b}) == 1
    assert a.summary() == "seqs=64 gpu=90%"
    assert Setting(max_num_seqs=8, gpu_memory_utilization_percent=95, max_num_batched_tokens=4096).summary() == \
        "seqs=8 gpu=95% tokens=4096"


def test_nan_metrics_are_stored_as_absent() -> None:
    metrics = TrialMetrics(ttft_ms=math.nan, itl_ms=12.5)
    assert metrics.ttft_ms is None and metrics.itl_ms == 12.5


def test_unknown_metrics_are_kept() -> None:
    metrics = TrialMetrics.model_validate({"ttftMs": 10, "queueMs": 3.5})
    assert metrics.model_dump(by_alias=True, exclude_none=True) == {"ttftMs": 10.0, "queueMs": 3.5}


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
        "pruned": [{"setting": {"maxNumSeqs": 1024, "gpuMemoryUtilizationPercent": 90}, "reason": "does not fit"}],
        "trials": [{"index": 0, "name": "bt-trial-0", "setting": setting, "state": "Done", "repeat": 0,
                    "startedAt": "2025-01-02T03:00:00Z", "finishedAt": "2025-01-02T03:04:00Z",
                    "metrics": {"itlMs": 31.5, "outputThroughput": 2400.0}, "verdict": "Met", "verdictReason": "all met"}],
        "bestTrial": "bt-trial-0", "bestSetting": "seqs=64 gpu=90%",
        "knee": {"maxNumSeqs": 64, "reason": "gain per doubling below 5%"},
        "recommendation": {"setting": setting, "args": ["--max-num-seqs", "64"], "reason": "best", "replicasHint": 2},
        "applied": {"previousArgs": ["a"], "newArgs": ["b"], "appliedAt": "2025-01-02T04:00:00Z"},
    }


def test_status_round_trips_through_its_wire_form() -> None:
    status = parse_status(full_status())
    assert status.phase is Phase.TRIALING and status.trials[0].state is TrialState.DONE
    assert status.trials[0].started_at == datetime(2025, 1, 2, 3, 0, tzinfo=timezone.utc)
    assert status.condition("Progressing").reason == "TrialRunning"
    assert parse_status(status.to_wire()) == status
    assert status.to_wire()["trials"][0]["startedAt"] == "2025-01-02T03:00:00Z"


def test_status_ignores_fields_it_does_not_know() -> None:
    assert parse_status({"phase": "Pending", "fromAFutureVersion": 1}).phase is Phase.PENDING


def test_empty_status_parses() -> None:
    assert parse_status(None) == BatchTuningStatus()


def test_status_errors_are_named_under_status() -> None:
    with pytest.raises(InvalidBatchTuning) as caught:
        parse_status({"phase": "Sleeping"})
    assert caught.value.paths == ["status.phase"]
