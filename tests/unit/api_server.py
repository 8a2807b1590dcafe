"""Offline stand-in for what the API server does to a BatchTuning create, beyond `api_crd`'s schema and CEL.

`api_crd.validate` checks the CRD; the real server also, before and around that:
- drops nulls the schema does not allow, or replaces them with the default where there is one, so
  `mode: null` is accepted as if unset (k8s.io/apiextensions-apiserver .../defaulting: prunenulls.go,
  algorithm.go);
- refuses unknown top-level and metadata fields (strict field validation, metadata included since 1.25);
- validates metadata as ObjectMeta: name a DNS-1123 subdomain, namespace a DNS label, label and
  annotation keys qualified names, label values;
- matches `pattern` with Go's RE2, where `$` is the end of the text (Python's `$` also matches
  before a final newline, so `api_crd`'s jsonschema accepts "llama-8b\\n").
Objects here are what kubectl sends: JSON-like data (integral floats already integers).
"""

from __future__ import annotations

import copy
import re
from functools import cache
from typing import Any

import api_crd
import jsonschema

ROOT = {"apiVersion", "kind", "metadata", "spec", "status"}
METADATA = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
            "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
            "ownerReferences", "finalizers", "managedFields"}
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
QUALIFIED = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")


def prune_nulls(value: Any, node: dict[str, Any]) -> Any:
    """A copy of value without the nulls the server drops (a null with a default is then defaulted)."""
    value = copy.deepcopy(value)
    _prune(value, node)
    return value


def _prune(value: Any, node: dict[str, Any] | None) -> None:
    if isinstance(value, dict):
        props = (node or {}).get("properties", {})
        for key in list(value):
            sub = props.get(key)
            if value[key] is None and sub is not None and not sub.get("nullable"):
                if "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])  # defaulting replaces a non-nullable null
                else:
                    del value[key]
            else:
                _prune(value[key], sub)
    elif isinstance(value, list):
        for item in value:
            _prune(item, (node or {}).get("items"))


def _go_patterns(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _go_patterns(v) for k, v in schema.items()}
        if isinstance(out.get("pattern"), str) and out["pattern"].endswith("$"):
            out["pattern"] = out["pattern"][:-1] + r"\Z"
        return out
    if isinstance(schema, list):
        return [_go_patterns(v) for v in schema]
    return schema


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_go_patterns(api_crd.to_json_schema(api_crd.openapi_schema())))


def _schema_errors(obj: Any) -> list[api_crd.CrdError]:
    out = []
    for err in _validator().iter_errors(obj):
        path = ""
        for part in err.absolute_path:
            path = f"{path}[{part}]" if isinstance(part, int) else (f"{path}.{part}" if path else str(part))
        out.append(api_crd.CrdError(path, err.message, "schema"))
    return out


def metadata_errors(meta: Any) -> list[api_crd.CrdError]:
    if not isinstance(meta, dict):
        return [api_crd.CrdError("metadata", "must be an object", "meta")]
    out = [api_crd.CrdError(f"metadata.{k}", "unknown field", "meta") for k in meta if k not in METADATA]
    name, generate = meta.get("name"), meta.get("generateName")
    if not name and not generate:
        out.append(api_crd.CrdError("metadata.name", "Required value", "meta"))
    if name is not None and (not isinstance(name, str) or len(name) > 253 or not DNS1123_SUBDOMAIN.match(name)):
        out.append(api_crd.CrdError("metadata.name", "Invalid value", "meta"))
    if meta.get("namespace") is not None and not (
            isinstance(meta["namespace"], str) and len(meta["namespace"]) <= 63 and DNS1123_LABEL.match(meta["namespace"])):
        out.append(api_crd.CrdError("metadata.namespace", "Invalid value", "meta"))

    def qualified(key: Any) -> bool:
        if not isinstance(key, str):
            return False
        prefix, slash, rest = key.rpartition("/")
        if slash and not (prefix and len(prefix) <= 253 and DNS1123_SUBDOMAIN.match(prefix)):
            return False
        return bool(rest) and len(rest) <= 63 and bool(QUALIFIED.match(rest))

    for key, value in (meta.get("labels") or {}).items():
        if not qualified(key) or not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            out.append(api_crd.CrdError("metadata.labels", f"Invalid value: {key!r}", "meta"))
    for key, value in (meta.get("annotations") or {}).items():
        if not qualified(key.lower() if isinstance(key, str) else key) or not isinstance(value, str):
            out.append(api_crd.CrdError("metadata.annotations", f"Invalid value: {key!r}", "meta"))
    return out


def validate(obj: Any) -> list[api_crd.CrdError]:
    """Every error the API server would give creating obj with fieldValidation=Strict; [] means accepted."""
    if not isinstance(obj, dict):
        return [api_crd.CrdError("", "must be an object", "server")]
    schema = api_crd.openapi_schema()
    pruned = prune_nulls(obj, schema)
    out = [api_crd.CrdError(str(k), "unknown field", "server") for k in pruned if k not in ROOT]
    out += metadata_errors(pruned.get("metadata"))
    pruned.pop("status", None)  # the status subresource: a create ignores status
    defaulted = api_crd.apply_defaults(pruned, schema)
    return out + _schema_errors(defaulted) + api_crd.cel_errors(defaulted, schema)
