"""The Python models and the CRD describe the same API: paths, types, enums, bounds, required fields, defaults."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import api_crd
import pytest
import yaml

from batchtune.api import API_GROUP, API_VERSION, KIND, PLURAL, BatchTuningSpec, BatchTuningStatus, parse_spec

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"
COMPARED = ("type", "format", "enum", "minimum", "maximum", "minLength", "maxLength", "pattern",
            "minItems", "maxItems", "required")


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's JSON schema with $refs inlined and Optional's anyOf-with-null unwrapped."""
    if "$ref" in schema:
        merged = copy.deepcopy(defs[schema["$ref"].split("/")[-1]])
        merged.update({k: v for k, v in schema.items() if k != "$ref"})
        return _resolve(merged, defs)
    if "anyOf" in schema:
        (only,) = [o for o in schema["anyOf"] if o.get("type") != "null"]
        merged = {k: v for k, v in schema.items() if k != "anyOf"}
        merged.update(only)
        return _resolve(merged, defs)
    out = dict(schema)
    if "enum" in out:
        out.setdefault("type", "string")
    if "properties" in out:
        out["properties"] = {k: _resolve(v, defs) for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = _resolve(out["items"], defs)
    return out


def _flatten(node: dict[str, Any], path: str, out: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    facts = {k: node[k] for k in COMPARED if k in node}
    if "required" in facts:
        facts["required"] = sorted(facts["required"])
    out[path] = facts
    for name, sub in node.get("properties", {}).items():
        _flatten(sub, f"{path}.{name}", out)
    if "items" in node:
        _flatten(node["items"], f"{path}[]", out)
    return out


def _model_facts(model: type, root: str) -> dict[str, dict[str, Any]]:
    # Status as the operator writes it (the CRD's status is generated from that); a tick's typed status reads more
    # (a running trial's steps back on the trial, test_api_status_wire.py).
    schema = model.model_json_schema(by_alias=True, mode="validation" if root == "spec" else "serialization")
    return _flatten(_resolve(schema, schema.pop("$defs", {})), root, {})


def _crd_facts(root: str) -> dict[str, dict[str, Any]]:
    return _flatten(api_crd.openapi_schema()["properties"][root], root, {})


@pytest.mark.parametrize("model, root", [
    pytest.param(BatchTuningSpec, "spec", id="spec"),
    pytest.param(BatchTuningStatus, "status", id="status"),
])
def test_models_and_crd_have_the_same_field_paths(model: type, root: str) -> None:
    in_models, in_crd = set(_model_facts(model, root)), set(_crd_facts(root))
    assert sorted(in_crd - in_models) == [], "fields in the CRD but not in the models"
    assert sorted(in_models - in_crd) == [], "fields in the models but not in the CRD"


@pytest.mark.parametrize("model, root", [
    pytest.param(BatchTuningSpec, "spec", id="spec"),
    pytest.param(BatchTuningStatus, "status", id="status"),
])
def test_models_and_crd_agree_on_types_enums_bounds_and_required(model: type, root: str) -> None:
    models, crd = _model_facts(model, root), _crd_facts(root)
    disagreements = {
        path: {"models": models[path], "crd": crd[path]}
        for path in sorted(set(models) & set(crd))
        if models[path] != crd[path]
    }
    assert disagreements == {}


def _minimal() -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / "batchtuning-minimal.yaml").read_text())["spec"]


def _full() -> dict[str, Any]:
    return yaml.safe_load((SAMPLES / "batchtuning-full.yaml").read_text())["spec"]


def _with_secret_name_only() -> dict[str, Any]:
    spec = _minimal()
    spec["prometheus"]["authSecretRef"] = {"name": "prom-token"}
    return spec


@pytest.mark.parametrize("make_spec", [
    pytest.param(_minimal, id="minimal-sample"),
    pytest.param(_full, id="full-sample"),
    pytest.param(_with_secret_name_only, id="nested-default-key"),
])
def test_models_and_crd_fill_the_same_defaults(make_spec) -> None:
    spec = make_spec()
    defaulted_by_crd = api_crd.apply_defaults(spec, api_crd.openapi_schema()["properties"]["spec"])
    defaulted_by_models = parse_spec(spec).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert defaulted_by_models == defaulted_by_crd


def test_every_crd_field_has_a_description() -> None:
    undescribed = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, sub in node.get("properties", {}).items():
            if not sub.get("description", "").strip():
                undescribed.append(f"{path}.{name}")
            walk(sub, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(api_crd.openapi_schema(), "")
    assert [p for p in undescribed if p != ".metadata"] == []


def test_crd_names_match_the_api_constants() -> None:
    crd = api_crd.crd()
    assert crd["metadata"]["name"] == f"{PLURAL}.{API_GROUP}"
    assert crd["spec"]["group"] == API_GROUP
    assert crd["spec"]["names"]["kind"] == KIND
    assert crd["spec"]["names"]["plural"] == PLURAL
    assert crd["spec"]["names"]["shortNames"] == ["bt"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert api_crd.version()["name"] == API_VERSION
    assert api_crd.version()["subresources"] == {"status": {}}


def test_printer_columns_point_at_fields_that_exist() -> None:
    crd_paths = set(_crd_facts("spec")) | set(_crd_facts("status"))
    for column in api_crd.version()["additionalPrinterColumns"]:
        path = column["jsonPath"].lstrip(".")
        if path.startswith("metadata."):
            continue
        field = path.split("[?", 1)[0]
        assert field in crd_paths, f"printer column {column['name']} reads {column['jsonPath']}, not in the schema"


def test_status_written_by_the_models_passes_the_crd() -> None:
    from datetime import UTC, datetime

    from batchtune.api import (
        AppliedRecord,
        Condition,
        ContainerArgs,
        Knee,
        LoadStepRecord,
        Phase,
        PrunedSetting,
        Reason,
        Recommendation,
        RunRecord,
        Setting,
        TrialRecord,
        TrialState,
        Verdict,
    )

    now = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    setting = Setting(max_num_seqs=64, gpu_memory_utilization_percent=90, max_num_batched_tokens=8192)
    status = BatchTuningStatus(
        observed_generation=2, phase=Phase.VERIFYING, trials_planned=3, trials_completed=1,
        conditions=[Condition(type="Progressing", status="True", reason="Verifying", last_transition_time=now)],
        trials=[TrialRecord(index=0, name="bt-trial-0", setting=setting, state=TrialState.DONE, started_at=now,
                            metrics={"itlMs": float("nan"), "outputThroughput": 1800.0, "customRatio": 0.5,
                                     "ttftMs": float("inf")},
                            verdict=Verdict.UNKNOWN, verdict_reason="itl missing", reason=Reason.MEASURED,
                            steps=[LoadStepRecord(load=8, results=[RunRecord(metrics={"itlMs": 20.0})]),
                                   LoadStepRecord(load=4, metrics={"itlMs": 10.0}, verdict=Verdict.MET, margin=0.5)])],
        pruned=[PrunedSetting(setting=setting, reason=Reason.DOES_NOT_FIT_MEMORY, message="no KV blocks",
                              memory_reason=Reason.KV_CACHE_TOO_SMALL)],
        best_trial="bt-trial-0", best_setting=setting.summary(), knee=Knee(max_num_seqs=64, reason="flat"),
        recommendation=Recommendation(setting=setting, args=["--max-num-seqs", "64"], reason="best"),
        applied=AppliedRecord(generation=2, target="llm", previous=ContainerArgs(args=["a"]),
                              new=ContainerArgs(args=["b"]), before={"itlMs": 20.0}, applied_at=now),
    )
    wire = status.to_wire()
    assert "itlMs" not in wire["trials"][0]["metrics"] and wire["trials"][0]["metrics"]["ttftMs"] == 1e12
    obj = yaml.safe_load((SAMPLES / "batchtuning-minimal.yaml").read_text()) | {"status": wire}
    assert api_crd.validate(obj) == []


def test_the_status_schema_is_generated_from_the_models() -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "hack" / "gen-crd-status"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_every_default_satisfies_the_cel_rules_at_its_level() -> None:
    # The API server refuses a CRD whose default (taken as-is, without nested defaults) fails a rule.
    failures = []

    def walk(node: dict[str, Any], path: str) -> None:
        if "default" in node:
            failures.extend(api_crd.cel_errors(node["default"], node, path))
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(api_crd.openapi_schema(), "")
    assert failures == []
