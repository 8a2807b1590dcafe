"""The largest object a CRD's structural schema admits, built from the schema itself (issue 22, section 9).

`largest(node)` walks an openAPIV3Schema node and returns the biggest JSON value the API server would accept
there: every list at its `maxItems` of the biggest item, every string at its `maxLength` (or its longest `enum`
value, or the longest `date-time` under its `maxLength`), every optional field set, every number at its widest
JSON spelling. A node with no such bound (a list without `maxItems`, a string without `maxLength` or `enum`, an
open map, `x-kubernetes-preserve-unknown-fields`) has no largest value: it is named in `Unbounded`, so a future
unbounded field fails the size test instead of slipping past it.

Characters are counted as the API server counts `maxLength`, one per character, and written as ASCII (one byte
each; JSON escapes could make a string of control characters up to 6 times longer).
"""

from __future__ import annotations

import json
import re
from typing import Any

WIDEST_NUMBER = -2.2250738585072014e-308
"""A finite float whose JSON spelling is the longest (24 characters)."""
WIDEST_INT = -9223372036854775808
"""int64's widest spelling, for an integer without a bound."""
READABLE_NUMBER = 2.2250738585072014e-308
"""The widest finite float above zero (23 characters): what a field the models bound below by 0 can hold."""
READABLE_INT = 9223372036854775807
"""int64's widest spelling at or above zero."""
READABLE_DATE_TIME = "2026-12-02T15:40:40.123456Z"
"""The longest RFC 3339 time the models write (they read longer spellings, and write them so)."""


class Unbounded(AssertionError):
    """A schema node without a largest value: the paths of every such node."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__("fields the CRD schema does not bound (no largest object exists):\n  " + "\n  ".join(paths))
        self.paths = paths


def largest(node: dict[str, Any], path: str = "", readable: bool = False) -> Any:
    """The largest value the schema node admits; raises `Unbounded` naming every unbounded node under it.

    `readable`: the largest value the models also read, as far as single fields go: a time is a time, a reason code
    starts with a capital letter, a number or an integer bounded below by 0 is not negative (rules across fields are
    the caller's to satisfy)."""
    problems: list[str] = []
    value = _largest(node, path or ".", problems, readable)
    if problems:
        raise Unbounded(problems)
    return value


def _largest(node: dict[str, Any], path: str, problems: list[str], readable: bool = False) -> Any:  # noqa: C901
    if node.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path}: x-kubernetes-preserve-unknown-fields (any content)")
        return {}
    if node.get("x-kubernetes-int-or-string"):
        problems.append(f"{path}: x-kubernetes-int-or-string")
        return 0
    kind = node.get("type")
    if "enum" in node:
        return max((v for v in node["enum"]), key=lambda v: len(json.dumps(v)))
    if kind == "object":
        out: dict[str, Any] = {}
        if "additionalProperties" in node and node["additionalProperties"] is not False:
            # A structural schema cannot bound a map's keys (no propertyNames): its size has no maximum.
            problems.append(f"{path}: an open map (additionalProperties); use fixed properties")
        for name, sub in (node.get("properties") or {}).items():
            out[name] = _largest(sub, f"{path}.{name}" if path != "." else f".{name}", problems, readable)
        return out
    if kind == "array":
        if "maxItems" not in node:
            problems.append(f"{path}: a list without maxItems")
            return []
        total = _characters_bound(node)
        if total is not None:
            return _strings_within(node, total)
        item = _largest(node.get("items") or {}, f"{path}[]", problems, readable)
        return [item] * int(node["maxItems"])
    if kind == "string":
        if "maxLength" not in node:
            problems.append(f"{path}: a string without maxLength")
            return ""
        if readable and node.get("format") == "date-time":
            return READABLE_DATE_TIME
        if readable and node.get("pattern") == "^[A-Z][A-Za-z0-9]*$":
            return "R" + "x" * (int(node["maxLength"]) - 1)
        return "x" * int(node["maxLength"])
    if kind == "integer":
        bounds = [b for b in (node.get("maximum"), node.get("minimum")) if b is not None]
        if len(bounds) < 2:
            return READABLE_INT if readable else WIDEST_INT
        return max((int(b) for b in bounds), key=lambda b: len(str(b)))
    if kind == "number":
        return READABLE_NUMBER if readable else WIDEST_NUMBER
    if kind == "boolean":
        return False
    problems.append(f"{path}: no type")
    return None


_TOTAL_RULE = re.compile(r"^self\.map\((\w+), size\(\1\)\)\.sum\(\) <= (\d+)$")


def _characters_bound(node: dict[str, Any]) -> int | None:
    """The total characters a list of strings may hold, where a CEL rule bounds it (`self.map(w, size(w)).sum() <=
    N`, Kubernetes' list library); None where none does."""
    if (node.get("items") or {}).get("type") != "string":
        return None
    bounds = [int(m.group(2)) for rule in node.get("x-kubernetes-validations") or ()
              if (m := _TOTAL_RULE.match(rule.get("rule", "")))]
    return min(bounds) if bounds else None


def _strings_within(node: dict[str, Any], total: int) -> list[str]:
    """The largest list of strings holding `total` characters together: every item there (each costs its quotes and
    a comma), the characters in the first ones, each item within its own maxLength."""
    items, count = node.get("items") or {}, int(node["maxItems"])
    longest, shortest = int(items.get("maxLength", total)), int(items.get("minLength", 0))
    left = total - shortest * count
    out = []
    for _ in range(count):
        extra = max(0, min(longest - shortest, left))
        out.append("x" * (shortest + extra))
        left -= extra
    return out


def size(value: Any) -> int:
    """Bytes of the value as compact JSON (how the API server stores a custom resource in etcd)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())



if __name__ == "__main__":
    # Where the bytes of the largest object go: `PYTHONPATH=operator:tests/unit python tests/unit/crd_size.py`.
    import test_api_object_size

    obj = test_api_object_size.largest_object()
    spec, status = obj["spec"], obj["status"]
    trials, running = status["trials"], status["running"]
    rest = {k: v for k, v in status.items() if k not in ("trials", "running")}
    print(f"largest object {size(obj)} B (budget {test_api_object_size.OBJECT_BUDGET_BYTES}): metadata "
          f"{size(obj['metadata'])} B (kopf's diff base: the spec again), spec {size(spec)} B, status {size(status)} B")
    print(f"  trials {size(trials)} B: {len(trials)} x {size(trials[0])} B, of which its kept steps "
          f"{len(trials[0]['steps'])} x {size(trials[0]['steps'][0])} B")
    print(f"  running {size(running)} B: {len(running)} x {size(running[0])} B, of which steps "
          f"{len(running[0]['steps'])} x {size(running[0]['steps'][0])} B and the open step's runs "
          f"{len(running[0]['open']['results'])} x {size(running[0]['open']['results'][0])} B")
    print(f"  the rest {size(rest)} B: " + ", ".join(f"{k} {size(v)}" for k, v in
                                                    sorted(rest.items(), key=lambda kv: -size(kv[1])) if size(v) > 1000))
    print(f"  metric maps at their widest: a trial's {size(trials[0]['metrics'])} B, a step's or a run's "
          f"{size(trials[0]['steps'][0]['metrics'])} B, a prediction's {size(trials[0]['prediction']['metrics'])} B")
    maps = json.dumps(obj).count('"ttftMs"')
    print(f"  metric maps: {maps}")
