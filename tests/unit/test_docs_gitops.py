"""docs/gitops.md's examples hold: every Argo CD Application against Argo CD's own CRD (v3.5.1,
tests/data/argocd), every BatchTuning and `spec.apply` snippet against batchtune's API, and the
detection table against the detector."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from batchtune.api import ApplySpec, parse_spec
from batchtune.core.gitops import Manager, detect

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "gitops.md").read_text()
ARGO_CRD = yaml.safe_load((ROOT / "tests" / "data" / "argocd" / "application-crd.yaml").read_text())


def blocks() -> list[Any]:
    docs = []
    for text in re.findall(r"```yaml\n(.*?)```", PAGE, flags=re.S):
        text = "\n".join(line[2:] if line.startswith("  ") and text.startswith("  ") else line
                         for line in text.splitlines())
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def of_kind(kind: str) -> list[dict]:
    return [d for d in blocks() if isinstance(d, dict) and d.get("kind") == kind]


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Fields of `obj` its (structural) schema does not declare: the API server would prune them silently."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if props is None and extra is None or schema.get("x-kubernetes-preserve-unknown-fields"):
            return []
        out = []
        for key, value in obj.items():
            if props and key in props:
                out += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{path}.{key}")
            elif not (path == "" and key in ("apiVersion", "kind", "metadata")):
                out.append(f"{path}.{key}")
        return out
    if isinstance(obj, list) and "items" in schema:
        return [f for item in obj for f in unknown_fields(item, schema["items"], f"{path}[]")]
    return []


def without_required(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: without_required(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [without_required(v) for v in schema]
    return schema


def test_the_argo_cd_application_example_matches_argo_cds_crd():
    apps = of_kind("Application")
    assert apps, "docs/gitops.md lost its Application example"
    version = next(v for v in ARGO_CRD["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    for app in apps:
        assert app["apiVersion"] == "argoproj.io/v1alpha1"
        assert unknown_fields(app, schema) == []
        jsonschema.validate(app, without_required(schema))  # types and enums (source/destination elided)
        rule = app["spec"]["ignoreDifferences"][0]
        assert rule["managedFieldsManagers"] == ["batchtune"]  # the operator's field manager
        assert "RespectIgnoreDifferences=true" in app["spec"]["syncPolicy"]["syncOptions"]
    broken = copy.deepcopy(apps[0])
    broken["spec"]["ignoreDifferences"][0]["managedFieldManagers"] = ["batchtune"]  # a typo is caught
    assert unknown_fields(broken, schema) == [".spec.ignoreDifferences[].managedFieldManagers"]


def test_the_batchtuning_examples_are_valid():
    tunings = of_kind("BatchTuning")
    assert len(tunings) >= 2
    for bt in tunings:
        parse_spec(bt["spec"])
    fragments = [d["spec"]["apply"] for d in blocks() if isinstance(d, dict) and "kind" not in d
                 and set(d.get("spec") or {}) == {"apply"}]
    assert fragments
    for apply in fragments:
        ApplySpec.model_validate(apply)


def test_the_pull_request_example_names_a_layout_and_the_carve_out_example_a_manager():
    modes = {bt["spec"]["apply"]["mode"]: bt["spec"]["apply"] for bt in of_kind("BatchTuning")}
    assert modes["PullRequest"]["git"]["layout"] in ("Manifest", "Kustomize", "HelmValues")
    assert modes["Auto"]["autoUnderManagers"] == ["ArgoCD"]


@pytest.mark.parametrize("meta, manager", [
    ({"labels": {"app.kubernetes.io/instance": "llama-8b"}}, Manager.ARGO_CD),
    ({"labels": {"argocd.argoproj.io/instance": "llama-8b"}}, Manager.ARGO_CD),
    ({"annotations": {"argocd.argoproj.io/tracking-id": "llama-8b:apps/Deployment:inference/llama-8b"}},
     Manager.ARGO_CD),
    ({"labels": {"kustomize.toolkit.fluxcd.io/name": "apps"}}, Manager.FLUX),
    ({"labels": {"helm.toolkit.fluxcd.io/name": "vllm"}}, Manager.FLUX),
    ({"annotations": {"meta.helm.sh/release-name": "vllm"}}, Manager.HELM),
])
def test_the_detection_table(meta, manager):
    obj = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": "llama-8b", "namespace": "inference", **meta}}
    assert detect(obj).managers[0] is manager
    for key in [*meta.get("labels", {}), *meta.get("annotations", {})]:
        assert f"`{key}" in PAGE or key.rsplit("/", 1)[0] in PAGE, key
