"""Container environment as the kubelet builds it: envFrom, env (with valueFrom), then $(VAR) expansion."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

# (namespace, name) -> data (decoded for secrets), or None when the object does not exist.
ObjectLookup = Callable[[str, str], Mapping[str, str] | None]


class EnvError(Exception):
    """The environment cannot be built: the container waits with reason CreateContainerConfigError."""


@dataclass(frozen=True)
class PodNetwork:
    pod_ip: str
    host_ip: str


_SUFFIXES = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(text: Any) -> Decimal:
    """A Kubernetes resource quantity (`500m`, `64Gi`, `1e3`) as a Decimal."""
    match = _QUANTITY.match(str(text).strip())
    if not match:
        raise ValueError(f"not a resource quantity: {text!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:
        raise ValueError(f"not a resource quantity: {text!r}") from exc
    return number * _SUFFIXES[match.group(2) or ""]


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names expand, `$$` escapes, unknown references stay."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REFERENCE.sub(replace, text)


def field_value(pod: Mapping[str, Any], path: str, network: PodNetwork) -> str:
    """The value of a downward-API `fieldRef.fieldPath`."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": network.pod_ip,
        "status.podIPs": network.pod_ip,
        "status.hostIP": network.host_ip,
        "status.hostIPs": network.host_ip,
    }
    if path in simple:
        return str(simple[path])
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if keyed:
        return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
    raise EnvError(f"fieldRef.fieldPath {path!r} is not supported")


def resource_value(
    container: Mapping[str, Any], ref: Mapping[str, Any], node_allocatable: Mapping[str, str]
) -> str:
    """The value of a `resourceFieldRef`: the limit (node allocatable when unset), over the divisor, rounded up."""
    resource = str(ref.get("resource", ""))
    section, _, name = resource.partition(".")
    if section not in ("limits", "requests") or not name:
        raise EnvError(f"resourceFieldRef.resource {resource!r} is not supported")
    values = (container.get("resources") or {}).get(section) or {}
    raw = values.get(name)
    if raw is None and section == "requests":
        raw = ((container.get("resources") or {}).get("limits") or {}).get(name)
    if raw is None:
        raw = node_allocatable.get(name, "0")
    divisor = parse_quantity(ref.get("divisor") or "1")
    if divisor == 0:
        raise EnvError(f"resourceFieldRef {resource!r}: divisor must not be 0")
    return str(math.ceil(parse_quantity(raw) / divisor))


def resolve_env(  # noqa: C901
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    network: PodNetwork,
    *,
    config_map: ObjectLookup,
    secret: ObjectLookup,
    node_allocatable: Mapping[str, str] | None = None,
) -> dict[str, str]:  # noqa: C901
    """The container's environment from its spec, in kubelet order (envFrom, then env)."""
    namespace = str((pod.get("metadata") or {}).get("namespace", "default"))
    allocatable = node_allocatable or {}
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        for kind, lookup in (("configMapRef", config_map), ("secretRef", secret)):
            ref = source.get(kind)
            if ref is None:
                continue
            data = lookup(namespace, str(ref.get("name", "")))
            if data is None:
                if ref.get("optional"):
                    continue
                noun = "configmap" if kind == "configMapRef" else "secret"
                raise EnvError(f'{noun} "{ref.get("name")}" not found')
            for key, value in data.items():
                env[prefix + key] = value
    for var in container.get("env") or []:
        name = str(var.get("name"))
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(str(var.get("value") or ""), env)
            continue
        source = var["valueFrom"] or {}
        if "fieldRef" in source:
            env[name] = field_value(pod, str(source["fieldRef"].get("fieldPath", "")), network)
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"], allocatable)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
            ref = source[kind]
            noun = "configmap" if kind == "configMapKeyRef" else "secret"
            data = (config_map if kind == "configMapKeyRef" else secret)(namespace, str(ref.get("name", "")))
            key = str(ref.get("key", ""))
            if data is None or key not in data:
                if ref.get("optional"):
                    continue
                if data is None:
                    raise EnvError(f'{noun} "{ref.get("name")}" not found')
                raise EnvError(f'couldn\'t find key {key} in {noun.capitalize()} {namespace}/{ref.get("name")}')
            env[name] = data[key]
        else:
            raise EnvError(f"env {name!r}: valueFrom {sorted(source)} is not supported")
    return env
