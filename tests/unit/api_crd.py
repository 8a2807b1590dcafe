"""Offline check of objects against the BatchTuning CRD: its structural schema (as JSON Schema) and its CEL rules.

What the API server does, minus what needs a server: defaults are applied first (CEL rules
read defaulted fields), unknown fields are errors (kubectl's strict field validation), a
`set` list must not repeat items, and each `x-kubernetes-validations` rule is evaluated with
celpy with `self` bound to the value at its level. A real API server check is separate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "batchtune.io_batchtunings.yaml"


@dataclass(frozen=True)
class CrdError:
    path: str
    message: str
    source: str  # "schema" or "cel"


@cache
def crd() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(CRD_PATH.read_text()) if d]
    assert len(docs) == 1, "the CRD file holds exactly one document"
    return docs[0]


def version() -> dict[str, Any]:
    (v,) = crd()["spec"]["versions"]
    return v


def openapi_schema() -> dict[str, Any]:
    return version()["schema"]["openAPIV3Schema"]


_KEEP = ("type", "format", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
         "minLength", "maxLength", "pattern", "minItems", "maxItems", "required")


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema -> JSON Schema (draft 2020-12) with the server's strictness."""
    out = {k: copy.deepcopy(node[k]) for k in _KEEP if k in node}
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def apply_defaults(value: Any, node: dict[str, Any]) -> Any:
    """A copy of value with the schema's defaults filled in, as the API server does before validating."""
    value = copy.deepcopy(value)
    _default_into(value, node)
    return value


def _default_into(value: Any, node: dict[str, Any]) -> None:
    if isinstance(value, dict) and "properties" in node:
        for name, sub in node["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_into(value[name], sub)
    elif isinstance(value, list) and "items" in node:
        for item in value:
            _default_into(item, node["items"])


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else part


def schema_errors(obj: Any) -> list[CrdError]:
    validator = jsonschema.Draft202012Validator(to_json_schema(openapi_schema()))
    out = []
    for err in validator.iter_errors(obj):
        path = ""
        for part in err.absolute_path:
            path = _join(path, part)
        out.append(CrdError(path, err.message, "schema"))
    return out


def _sum(values: Any) -> Any:
    """Kubernetes' CEL list library `sum` (integers here, as the CRD's rules use it)."""
    return celpy.celtypes.IntType(sum(int(v) for v in values))


@cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions={"sum": _sum})


def cel_errors(value: Any, node: dict[str, Any], path: str = "") -> list[CrdError]:
    out: list[CrdError] = []
    for rule in node.get("x-kubernetes-validations", []):
        try:
            ok = bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)}))
            message = rule.get("message", f"failed rule: {rule['rule']}")
        except Exception as exc:  # a rule that cannot evaluate rejects the object on the server too
            ok, message = False, f"rule {rule['rule']!r} did not evaluate: {exc}"
        if not ok:
            out.append(CrdError(path + rule.get("fieldPath", ""), message, "cel"))
    if isinstance(value, dict) and "properties" in node:
        for name, sub in node["properties"].items():
            if name in value:
                out += cel_errors(value[name], sub, _join(path, name))
    elif isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            out += cel_errors(item, node["items"], _join(path, i))
    return out


def validate(obj: Any) -> list[CrdError]:
    """Every schema and CEL error of obj after defaulting; [] means the CRD accepts it."""
    schema = openapi_schema()
    defaulted = apply_defaults(obj, schema)
    errors = schema_errors(defaulted)
    return errors + cel_errors(defaulted, schema)


def related(a: str, b: str) -> bool:
    """True when one path is the other or an ancestor of it (spec.load is related to spec.load.numPrompts)."""
    def parts(p: str) -> list[str]:
        return p.replace("[", ".[").split(".") if p else []
    pa, pb = parts(a), parts(b)
    n = min(len(pa), len(pb))
    return pa[:n] == pb[:n]
