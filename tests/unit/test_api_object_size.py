"""The largest BatchTuning the CRD admits, and its report ConfigMap, fit in etcd (issue 22, section 9).

The largest object is built from the CRD's openAPIV3Schema (`crd_size.largest`), never from hand-written
figures: a field added without a bound makes it impossible to build, and fails here by name.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import api_crd
import crd_size
import pytest
import yaml

from batchtune.api import parse_status
from batchtune.api.models import (
    MAX_REPEATS,
    MAX_RUNNING_IN_STATUS,
    MAX_STEPS_IN_STATUS,
    MAX_TRIAL_INDEX,
    MAX_TRIALS_IN_STATUS,
)

ETCD_LIMIT_BYTES = 1_572_864
"""etcd's default request limit (--max-request-bytes, 1.5 MiB): a larger object cannot be written."""
OBJECT_BUDGET_BYTES = 1_048_576
"""What the whole object (metadata, spec and status at their largest) must stay under, well inside etcd's limit."""
CONFIGMAP_LIMIT_BYTES = 1_048_576
"""A ConfigMap's data and binaryData together (the API server's own check)."""
DIFFBASE_ANNOTATION = "batchtune.io/last-handled-configuration"
SAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "batchtuning-full.yaml"
"""kopf's diff base (`handlers.configure`): a copy of the spec inside the object's own metadata."""

def _schema() -> dict:
    return api_crd.openapi_schema()


def _metadata(spec: dict) -> dict:
    """The metadata of a BatchTuning at its largest as far as batchtune shapes it: a name and namespace at
    their limits, the finalizer, and kopf's diff base (the spec again, as JSON in an annotation)."""
    return {
        "name": "n" * 253, "namespace": "n" * 63, "uid": "u" * 36, "resourceVersion": "9" * 20,
        "generation": crd_size.WIDEST_INT, "creationTimestamp": "2026-12-02T15:40:40Z",
        "finalizers": ["batchtune.io/finalizer"],
        "annotations": {DIFFBASE_ANNOTATION: json.dumps({"spec": spec}, separators=(",", ":"))},
    }


def largest_object() -> dict:
    root = _schema()["properties"]
    spec = crd_size.largest(root["spec"], ".spec")
    status = crd_size.largest(root["status"], ".status")
    return {"apiVersion": "batchtune.io/v1alpha1", "kind": "BatchTuning", "metadata": _metadata(spec),
            "spec": spec, "status": status}


def test_the_walker_finds_an_unbounded_list_string_or_map() -> None:
    # The size test is only as good as its walker: each kind of unbounded node must be named.
    schema = {"type": "object", "properties": {
        "ok": {"type": "string", "maxLength": 3},
        "list": {"type": "array", "items": {"type": "integer"}},
        "text": {"type": "string"},
        "map": {"type": "object", "additionalProperties": {"type": "number"}},
        "any": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    }}
    with pytest.raises(crd_size.Unbounded) as caught:
        crd_size.largest(schema)
    assert caught.value.paths == [".list: a list without maxItems", ".text: a string without maxLength",
                                  ".map: an open map (additionalProperties); use fixed properties",
                                  ".any: x-kubernetes-preserve-unknown-fields (any content)"]


def test_the_walker_fills_every_bound() -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5},
        "state": {"type": "string", "enum": ["Done", "Infeasible"]},
        "steps": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "score": {"type": "number"},
    }}
    assert crd_size.largest(schema) == {"name": "xxxxx", "state": "Infeasible", "steps": [1000, 1000, 1000],
                                        "score": crd_size.WIDEST_NUMBER}


def test_the_walker_fills_a_total_bound_on_a_list_of_strings() -> None:
    # A CEL rule bounding the characters of a list together (command lines) bounds it more than its items' maxLength.
    rule = {"rule": "self.map(w, size(w)).sum() <= 10"}
    schema = {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 6},
              "x-kubernetes-validations": [rule]}
    assert crd_size.largest(schema) == ["xxxxxx", "xxxx", "", ""]
    assert crd_size.largest({**schema, "x-kubernetes-validations": [{"rule": "size(self) <= 2"}]}) == ["xxxxxx"] * 4
    assert api_crd.cel_errors(["x" * 6, "x" * 5], schema) != [] and api_crd.cel_errors(["x" * 6, "x" * 4], schema) == []


def test_the_largest_spec_is_bounded_and_fits() -> None:
    spec = crd_size.largest(_schema()["properties"]["spec"], ".spec")
    # Twice: in spec and as kopf's diff base in metadata.
    assert 2 * crd_size.size(spec) < OBJECT_BUDGET_BYTES // 4, crd_size.size(spec)


def test_no_status_field_is_unbounded() -> None:
    # Every list, string and map of status has a bound, the container command lines included (64 words of at most
    # 512 characters: planning refuses a longer one rather than cut it, tests/unit/test_reconcile_command_line.py).
    status = crd_size.largest(_schema()["properties"]["status"], ".status")
    assert len(status["baseline"]["args"]) == len(status["applied"]["previous"]["command"]) == 64


def test_the_largest_batchtuning_the_crd_admits_fits_in_etcd() -> None:
    obj = largest_object()
    total = crd_size.size(obj)
    assert total <= OBJECT_BUDGET_BYTES, (
        f"the largest BatchTuning is {total} bytes (status {crd_size.size(obj['status'])}, spec "
        f"{crd_size.size(obj['spec'])}): over the {OBJECT_BUDGET_BYTES}-byte budget (etcd: {ETCD_LIMIT_BYTES})")


def largest_readable_status() -> dict:
    """The largest status the operator reads back: the schema's largest, readable field by field (`crd_size.largest`
    with `readable`), and what holds across fields: distinct trial indexes, the first trials running, each with its
    record in status.running whose open step is among its steps (a running trial's own steps are there, not on it)."""
    status = crd_size.largest(_schema()["properties"]["status"], ".status", readable=True)
    running = len(status["running"])
    trials = []
    for i, trial in enumerate(status["trials"]):
        index = MAX_TRIAL_INDEX - i  # the widest spelling of distinct indexes
        if i < running:
            trial = {k: v for k, v in trial.items() if k != "steps"}
            entry = status["running"][i]
            opened = {k: v for k, v in entry["steps"][-1].items() if k != "verdict"}  # open: not judged yet
            status["running"][i] = {**entry, "index": index, "steps": [*entry["steps"][:-1], opened],
                                    "open": {**entry["open"], "step": len(entry["steps"]) - 1}}
        trials.append({**trial, "index": index, "state": "Measuring" if i < running else "Infeasible"})
    status["trials"] = trials
    return status


def test_the_largest_readable_status_is_read_and_written_back_whole() -> None:
    # The builder's status is one the operator reads, and writes back with every trial, step and run it read.
    wire = largest_readable_status()
    typed = parse_status(wire)
    assert len(typed.trials) == MAX_TRIALS_IN_STATUS and typed.running == []
    assert [len(t.steps) for t in typed.trials[:MAX_RUNNING_IN_STATUS]] == [MAX_STEPS_IN_STATUS] * MAX_RUNNING_IN_STATUS
    assert len(typed.trials[0].steps[-1].results) == MAX_REPEATS
    assert typed.to_wire() == wire


def test_the_report_configmap_of_the_largest_status_fits() -> None:
    from batchtune.controller.reports import configmap

    spec = yaml.safe_load(SAMPLE.read_text())["spec"]  # the sample with every spec field set: spec adds little
    body = configmap("n" * 63, "n" * 253, "u" * 36, spec, largest_readable_status(), b"\x89PNG" + b"\0" * 900_000,
                     "2026-12-02 15:40 UTC")
    # As the API server counts a ConfigMap: data's keys and values, binaryData's keys and decoded bytes.
    held = sum(len(k) + len(v.encode()) for k, v in body["data"].items()) + \
        sum(len(k) + len(base64.b64decode(v)) for k, v in (body.get("binaryData") or {}).items())
    assert held <= CONFIGMAP_LIMIT_BYTES, f"the report ConfigMap holds {held} bytes: {sorted(body['data'])}"
    assert len(json.loads(body["data"]["trials.json"])["trials"]) == MAX_TRIALS_IN_STATUS  # every trial kept
    assert crd_size.size(body) < ETCD_LIMIT_BYTES


def test_the_twin_parameters_status_keeps_are_every_fitted_parameter() -> None:
    import dataclasses

    from batchtune.api.models import TWIN_PARAMETER_KEYS, camel
    from batchtune.twin.params import GenericStepModel, TwinParams

    fields = [camel(f.name) for f in dataclasses.fields(TwinParams) if f.name != "generic"]
    generic = [camel(f"generic_{f.name}") for f in dataclasses.fields(GenericStepModel)]
    assert sorted(TWIN_PARAMETER_KEYS) == sorted(fields + generic)


def _keys(node: dict) -> set[str]:
    return set(node["properties"])


def test_each_record_keeps_the_figures_its_writer_can_write() -> None:
    # A figure costs 41 bytes on average at its widest, in every step, run and prediction: each record's map holds
    # what is written there, and the CRD says so.
    from batchtune.core.vocabulary import CONCLUSION_METRICS, PREDICTED_METRICS, STEP_METRICS, TRIAL_METRICS, M

    status = _schema()["properties"]["status"]["properties"]
    trial = status["trials"]["items"]["properties"]
    running = status["running"]["items"]["properties"]
    step_keys = {str(m) for m in STEP_METRICS}
    assert _keys(trial["steps"]["items"]["properties"]["metrics"]) == step_keys
    assert _keys(running["steps"]["items"]["properties"]["metrics"]) == step_keys
    assert _keys(running["open"]["properties"]["results"]["items"]["properties"]["metrics"]) == step_keys
    assert _keys(trial["metrics"]) == {str(m) for m in TRIAL_METRICS}
    predicted = {str(m) for m in PREDICTED_METRICS}
    assert _keys(trial["prediction"]["properties"]["metrics"]) == predicted
    assert _keys(status["twin"]["properties"]["predictions"]["items"]["properties"]["metrics"]) == predicted
    assert _keys(status["applied"]["properties"]["before"]) == {str(m) for m in M}  # production's window
    assert not step_keys & {str(m) for m in CONCLUSION_METRICS} and str(M.REQUESTS) not in step_keys | _keys(trial["metrics"])


def test_a_load_run_measures_only_step_figures_and_a_trial_adds_only_its_conclusions() -> None:
    # What justifies the step maps' keys: every figure a run's reading can hold (Prometheus' trial queries, the KV
    # pool, the load generator's counts) is one of STEP_METRICS, and concluding a trial adds only CONCLUSION_METRICS.
    from batchtune.api.models import RunRecord
    from batchtune.core import promql, protocol
    from batchtune.core.measurement import run_result
    from batchtune.core.objective import Objective
    from batchtune.core.promql import LabelNames, MetricNames, QueryContext
    from batchtune.core.slo import SloTargets
    from batchtune.core.vocabulary import CONCLUSION_METRICS, STEP_METRICS, UNKEPT_METRICS, M
    from batchtune.engines import VLLM

    ctx = QueryContext(MetricNames.build(VLLM.metrics), LabelNames(), LabelNames(model=None), 95)
    prometheus = {k: 0.0 if k.startswith("waiting") else 50.0 for k in promql.trial_queries(ctx, "ns", "pod", "model", 60)}
    prometheus[M.KV_POOL_TOKENS] = 1e5
    summary = {"completed": 990, "failed": 10, "samples": 1000, "in_flight": 3, "offered_request_rate": 9.0,
               "request_goodput": 8.0, "mean_ttft_ms": 40.0, "mean_itl_ms": 9.0, "p95_ttft_ms": 80.0,
               "p95_itl_ms": 12.0, "p95_e2el_ms": 900.0}
    run = run_result(prometheus, summary, 95)
    kept = set(STEP_METRICS) | set(UNKEPT_METRICS)
    assert set(run.metrics) <= kept, set(run.metrics) - kept
    assert len(run.metrics) >= len(kept) - 1, kept - set(run.metrics)  # the step maps are used
    # What a run record in status holds of it: its step figures, never the unkept ones.
    assert set(RunRecord.model_validate({"metrics": run.metrics}).metrics) == set(run.metrics) & set(STEP_METRICS)

    config = protocol.ProtocolConfig(Objective.SLO_CAPACITY, SloTargets(ttft_ms=1000, max_error_rate_percent=5.0),
                                     open_loop=False)
    step = protocol.close_step(16, [run], config)
    assert step.passed, step
    conclusion = protocol.conclude([step], config)
    added = set(conclusion.metrics) - set(step.metrics)
    assert added and added <= set(CONCLUSION_METRICS), added


def test_a_prediction_holds_every_figure_the_twin_predicts_and_the_report_compares() -> None:
    from batchtune.core.vocabulary import PREDICTED_METRICS
    from batchtune.report_html import COMPARED
    from batchtune.twin.guide import bench_names

    assert set(bench_names(95)) | {key for key, _, _ in COMPARED} == set(PREDICTED_METRICS)
