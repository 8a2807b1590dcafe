"""`batchtune validate`, the operator and the API server agree on what is valid, over many generated cases.

Each case is a sample BatchTuning with one field replaced (by null, "", the wrong type, a bound and
one past it, an enum value misspelt, an unknown key...). It is written out as YAML and read back by
`batchtune.api.load_file`, as `batchtune validate` reads a file, and sent to `api_server.validate`
(the CRD's schema and CEL rules plus what the API server does around them) as kubectl would send
it. Both must accept it or both refuse it, naming related fields. The one deliberate difference:
an explicit null in spec, which the API server drops without a word (so the default applies) and
batchtune refuses; those cases are checked to be exactly that.

The operator parses the spec it reads from the API server with `parse_spec`: on every case the API server
stores, it must judge the stored spec as `load_file` judged the file (the same cases, judged once by the server).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import api_crd
import api_server
import pytest
import yaml

from batchtune.api import NULL_MESSAGE, InvalidBatchTuning, load_file, parse_spec

REPO = Path(__file__).resolve().parents[2]
SAMPLES = {p.stem.removeprefix("batchtuning-"): [d for d in yaml.safe_load_all(p.read_text()) if d][0]
           for p in sorted((REPO / "manifests" / "samples").glob("*.yaml"))}


def _fields(node: dict[str, Any], path: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], dict[str, Any]]]:
    out = [(path, node)] if path else []
    for key, sub in (node.get("properties") or {}).items():
        out += _fields(sub, path + (key,))
    if "items" in node:
        out += _fields(node["items"], path + (0,))
    return out


SPEC_FIELDS = _fields(api_crd.openapi_schema()["properties"]["spec"], ("spec",))


def _values(node: dict[str, Any]) -> list[Any]:
    kind = node.get("type")
    out: list[Any] = [None, "", True, 1.5, [], {}, "x", {"zzz": 1}]
    if kind == "integer":
        out += [8.0, "8", -1, 2 ** 40]
        out += [node[b] + d for b, d in (("minimum", -1), ("minimum", 0), ("maximum", 0), ("maximum", 1)) if b in node]
    if kind == "string":
        out += [1, "a" * 3000, "x\n", "\x1b[2J"]
        for value in node.get("enum", []):
            out += [value, value.lower(), value + " "]
        if "pattern" in node:
            out += ["UPPER", "with space", "a" * 300]
    if kind == "string" and ("pattern" in node or "x-kubernetes-validations" in node):
        # Issue 22's hostile inputs, where a rule reads strings: Prometheus' reserved label names, keys Kubernetes
        # refuses, non-references as images, extra flags of the wrong form (which flags, and their values, are
        # checked at planning). Only there: every case costs both validators a run.
        out += ["__name__", "__x", "le", "quantile", ".", "..", "..data", ".hidden", "UPPER/case:1", "a//b:1",
                "reg.example.com:5000/team/lg:1", "x@sha256:" + "0" * 64, "--enforce-eager=false", "--dtype",
                "--max_num_seqs=8", "--a=$(HOME)"]
    if kind == "array":
        out += [[None], ["x"], [1, 1], [16, 32], list(range(16, 16 + 70))]
    if kind == "boolean":
        out += ["true", 0, False]
    return out


def _set(obj: Any, path: tuple[str | int, ...], value: Any) -> bool:
    for part in path[:-1]:
        if isinstance(part, int):
            if not isinstance(obj, list) or not obj:
                return False
            obj = obj[0]
        else:
            if not isinstance(obj, dict):
                return False
            obj = obj.setdefault(part, {})
    last = path[-1]
    if isinstance(last, int):
        if not isinstance(obj, list) or not obj:
            return False
        obj[0] = value
    elif isinstance(obj, dict):
        obj[last] = value
    else:
        return False
    return True


def _as_kubectl_sends(value: Any) -> Any:
    """kubectl's YAML-to-JSON: a float with no fraction goes out as an integer."""
    if isinstance(value, dict):
        return {k: _as_kubectl_sends(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_kubectl_sends(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _models(obj: dict[str, Any], tmp: Path) -> list[Any]:
    tmp.write_text(yaml.safe_dump(obj, sort_keys=False))
    try:
        load_file(tmp)
    except InvalidBatchTuning as exc:
        return exc.errors
    return []


def _related(model_paths: list[str], server_paths: list[str]) -> bool:
    return any(api_crd.related(m, s) for m in model_paths for s in server_paths)


def _null_in_spec(obj: Any, path: tuple[str | int, ...] = ()) -> bool:
    if isinstance(obj, dict):
        return any((v is None and path[:1] == ("spec",)) or _null_in_spec(v, path + (k,)) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_null_in_spec(v, path + (i,)) for i, v in enumerate(obj))
    return False


def _compare(case: dict[str, Any], tmp: Path) -> str | None:
    """None when validate, the API server and the operator agree (or differ only as designed), else how they differ."""
    model = _models(case, tmp)
    server = api_server.validate(_as_kubectl_sends(case))
    if bool(model) == bool(server):
        if model and not _related([e.path for e in model], [e.path for e in server]):
            return f"both refuse, at unrelated fields: models {[e.path for e in model]}, server {[e.path for e in server]}"
        return None if model or _null_in_spec(case) else _operator_disagrees(case, model)
    if model and not server and _null_in_spec(case):
        if all(e.message == NULL_MESSAGE for e in model):
            return None  # the deliberate difference
        return f"a null case refused for something else: {[str(e) for e in model]}"
    side = "models" if model else "API server"
    return f"only the {side} refuses: {[str(e) for e in model] or [f'{e.path}: {e.message}' for e in server]}"


def _operator_disagrees(case: dict[str, Any], model: list[Any]) -> str | None:
    """On a case the API server stores, the operator's parse_spec judges it as validate (load_file) does."""
    # The operator sees the spec after the API server: nulls dropped, defaults filled in, floats with no
    # fraction as integers.
    stored = api_server.prune_nulls(_as_kubectl_sends(case), api_crd.openapi_schema())
    try:
        parse_spec(stored["spec"])
        operator: list[Any] = []
    except InvalidBatchTuning as exc:
        operator = exc.errors
    if bool(model) == bool(operator):
        return None
    return f"validate {'refuses' if model else 'accepts'}, the operator {'refuses' if operator else 'accepts'}: " \
           f"{[str(e) for e in model + operator]}"


@pytest.mark.parametrize("sample", sorted(SAMPLES))
@pytest.mark.parametrize("path, node", [pytest.param(p, n, id=".".join(map(str, p))) for p, n in SPEC_FIELDS])
def test_a_replaced_spec_field_is_judged_alike(sample: str, path: tuple[str | int, ...], node: dict[str, Any],
                                                tmp_path: Path) -> None:
    disagreements = []
    for value in _values(node):
        case = copy.deepcopy(SAMPLES[sample])
        if not _set(case, path, value):
            continue
        problem = _compare(case, tmp_path / "case.yaml")
        if problem:
            disagreements.append(f"{value!r:.40}: {problem}")
    assert not disagreements, "\n".join(disagreements)


@pytest.mark.parametrize("edit", [
    pytest.param(lambda o: o.update(mode="Recommend"), id="unknown-top-level-field"),
    pytest.param(lambda o: o.update(specs=o["spec"]), id="top-level-typo"),
    pytest.param(lambda o: o.update(status=None), id="status-null"),
    pytest.param(lambda o: o.update(status={}), id="status-empty"),
    pytest.param(lambda o: o.update(spec=None), id="spec-null"),
    pytest.param(lambda o: o.pop("spec"), id="spec-missing"),
    pytest.param(lambda o: o["metadata"].update(name="Llama_8B"), id="name-not-dns"),
    pytest.param(lambda o: o["metadata"].update(name="a" * 253), id="name-253"),
    pytest.param(lambda o: o["metadata"].update(name="a" * 254), id="name-254"),
    pytest.param(lambda o: o["metadata"].update(name="llama.8b"), id="name-with-dot"),
    pytest.param(lambda o: o["metadata"].update(name="-llama"), id="name-leading-dash"),
    pytest.param(lambda o: o["metadata"].update(name=8), id="name-number"),
    pytest.param(lambda o: o["metadata"].update(name="\x1b[2J"), id="name-escape"),
    pytest.param(lambda o: o["metadata"].update(nmae="x"), id="metadata-typo"),
    pytest.param(lambda o: o["metadata"].update(namespace="Bad_NS"), id="namespace-not-dns"),
    pytest.param(lambda o: o["metadata"].update(namespace="a" * 64), id="namespace-64"),
    pytest.param(lambda o: o["metadata"].update(labels={"team": "inference"}), id="label-ok"),
    pytest.param(lambda o: o["metadata"].update(labels={"example.com/team": "a.b-c_d"}), id="label-prefixed"),
    pytest.param(lambda o: o["metadata"].update(labels={"a b": "x"}), id="label-key-space"),
    pytest.param(lambda o: o["metadata"].update(labels={"team": "x" * 64}), id="label-value-64"),
    pytest.param(lambda o: o["metadata"].update(labels={"team": ""}), id="label-value-empty"),
    pytest.param(lambda o: o["metadata"].update(labels={"Example.com/team": "x"}), id="label-prefix-upper"),
    pytest.param(lambda o: o["metadata"].update(annotations={"note": "any text\nat all"}), id="annotation-ok"),
    pytest.param(lambda o: o["metadata"].update(annotations={"bad key!": "x"}), id="annotation-key"),
    pytest.param(lambda o: o["spec"].update(search_space=o["spec"].pop("searchSpace")), id="snake-case-key"),
    pytest.param(lambda o: o["spec"]["slo"].update(ttft_milliseconds=100), id="snake-case-nested-key"),
    pytest.param(lambda o: o["metadata"].update(creationTimestamp=None), id="dry-run-null-timestamp"),
    pytest.param(lambda o: o["metadata"].update(labels=None), id="labels-null"),
    pytest.param(lambda o: o["metadata"].pop("name") and o["metadata"].update(generateName="llama-"),
                 id="generate-name"),
])
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_a_changed_object_or_metadata_is_judged_alike(sample: str, edit: Any, tmp_path: Path) -> None:
    case = copy.deepcopy(SAMPLES[sample])
    edit(case)
    assert _compare(case, tmp_path / "case.yaml") is None


def test_the_generated_cases_cover_every_spec_field_and_refuse_many() -> None:
    assert len(SPEC_FIELDS) > 60
    assert sum(len(_values(n)) for _, n in SPEC_FIELDS) > 1000


@pytest.mark.parametrize("path, value", [
    pytest.param(("spec", "prometheus", "labels", "pod"), "__name__", id="label-name"),
    pytest.param(("spec", "prometheus", "labels", "model"), "le", id="label-le"),
    pytest.param(("spec", "prometheus", "gpuLabels", "namespace"), "__meta_x", id="gpu-label-meta"),
    pytest.param(("spec", "prometheus", "authSecretRef"), {"name": "s", "key": ".."}, id="secret-key-dotdot"),
    pytest.param(("spec", "prometheus", "authSecretRef"), {"name": "s", "key": "."}, id="secret-key-dot"),
    pytest.param(("spec", "load", "traceConfigMapRef"), {"name": "t", "key": "..data"}, id="configmap-key"),
    pytest.param(("spec", "load", "image"), "UPPER/case:1", id="image-upper"),
    pytest.param(("spec", "load", "image"), "lg:1 && curl evil", id="image-shell"),
    pytest.param(("spec", "load", "image"), "reg.example.com/x@sha256:short", id="image-digest"),
])
def test_the_hostile_inputs_of_issue_22_are_refused_by_validate_and_the_api_server(path, value, tmp_path: Path) -> None:
    case = copy.deepcopy(SAMPLES["minimal"])
    assert _set(case, path, value)
    model = _models(case, tmp_path / "case.yaml")
    server = api_server.validate(_as_kubectl_sends(case))
    assert model and server, (model, server)
    assert _related([e.path for e in model], [e.path for e in server])
